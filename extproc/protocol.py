"""Names the generated Envoy config and the processor must agree on.

Kept in one light module (no gRPC import) so that the Envoy config generator,
the processor and the clients read the same names.
"""

# Dynamic-metadata namespace that Envoy's json_to_metadata filter writes the body fields into.
METADATA_NAMESPACE = "extproc"
# Set by the processor on released requests; Envoy copies it onto the response
# (ext_proc itself skips response headers), so clients and logs see the wait.
QUEUE_WAIT_HEADER = "x-extproc-queue-wait-ms"
# On the processor's own answers: why it answered instead of the engine.
REASON_HEADER = "x-extproc-reason"
# Gateway API Inference Extension convention: the endpoint picked for a request
# (HOST:PORT); Envoy routes requests carrying it to an ORIGINAL_DST cluster.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
