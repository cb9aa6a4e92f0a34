"""How Envoy attached the processor, per stream: the seam between the servicer and each kind of gateway.

* ``base.py``             the seam: :class:`~base.Stream` (a request as its stream brings it) and
  :class:`~base.Attachment` (what an attachment owes the servicer);
* ``own_envoy.py``        our own Envoy config or drop-in: the body's fields in our metadata, the fast path;
* ``endpoint_picker.py``  a Gateway API Inference Extension gateway: the body read from the stream,
  the Endpoint Picker Protocol's release;
* ``body.py``             what each body mode brings and wants back, and the one release builder;
* ``served.py``           what a stream reads of its model (``ServedModel``), a narrow view of its runtime;
* ``replies.py``          the replies every attachment builds from: a header, the JSON error, a pass;
* ``release_outcome.py``  whether a response's headers show a live engine, a full one or a failed release;
* ``stream_start.py``     a stream's first event, read before its headers go on: the engine's refusal inside a 200;
* ``priority_body.py``    the band's priority written into the body (engine_priority models).

The servicer picks :class:`~own_envoy.OwnEnvoy` when the first message
carries our metadata namespace, else :class:`~endpoint_picker.EndpointPicker`;
the shape of every reply follows the body modes Envoy declared for the
stream, whichever it picked. With both bodies in one mode (as the gateways
set them; ``tests/stack/test_attach_matrix.py`` runs each through Envoy 1.40):

============================  ======================  ==========================  ==========================
                              ``NONE``                ``BUFFERED``                ``FULL_DUPLEX_STREAMED``
============================  ======================  ==========================  ==========================
our metadata forwarded        the fast path           held on the headers, the    the body read and held,
                                                      body answered after         given back after release
no metadata (Endpoint Picker) 400 ``model_missing``,  held on the body message    the body read and held,
                              logged once                                         given back after release
============================  ======================  ==========================  ==========================
"""
