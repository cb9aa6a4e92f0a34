"""OpenAI's Batch API, run through the fair queue on idle capacity (docs/batches.md).

Where it is served and where it runs:

* The API (``api.py``, aiohttp like the metrics port) is served by ``extproc
  serve`` on ``batches.listen``. The generated Envoy routes ``/v1/files`` and
  ``/v1/batches`` to it after the auth filter, ext_proc off on those routes,
  so the tenant header Envoy's auth set is trusted exactly as for live
  requests: a tenant sees and cancels only its own files and batches.
* The runner (``local_runner.py``) is part of ``extproc serve`` too: it shares the
  config, the metrics registry and the process's lifecycle, and it only
  waits on HTTP. It sends each line through Envoy, on a listener of its own
  (``batches.runner_listen``: the same filter chain without the auth
  filters, the tenant header kept), as the batch's tenant and in the lowest
  class its entitlement allows, so a line meets the same admission, queue,
  gate, endpoint choice, engine retries and preemption as live traffic, with
  no second copy of any of them. Through Envoy rather than straight into the
  dispatcher because those parts live in Envoy and in the ext_proc stream;
  going around them would mean rebuilding the release, preemption's reset
  of the engine's request and Envoy's retries in the runner.
* At most ``in_flight_per_batch`` lines of a batch (``max_in_flight`` in all)
  are in flight, so our own queue holds a bounded number of each batch's
  lines. A line the gateway answers with a retryable refusal (``preempted``,
  ``queue_timeout``, ...) is sent again after its Retry-After, never failed
  for it.
* State is in SQLite under ``batches.directory`` (``local_store.py``) and the
  files' contents in a file store (``files.py``: ``batches.directory/files``,
  or an S3 bucket, ``s3.py``): each line's outcome is committed before its
  slot goes to the next line, so a restart resumes without losing or
  duplicating one (a line in flight at the crash is sent again).
* With ``cluster:`` the instances share the batches instead: state, line
  leases and each outcome once in the cluster's Redis (``cluster_store.py``,
  ``cluster_store.lua``), the files in a bucket or on a directory every instance
  mounts, and every instance runs a share of every batch's lines
  (``cluster_runner.py``). ``batches:`` is refused with ``shards:``.

Modules: ``files.py`` and ``s3.py`` (the files' contents), ``lines.py`` (an
input file read and validated, pure), ``shapes.py`` (OpenAI's objects and
errors), ``sender.py`` (one line through the gateway), ``continuation.py`` (a long
line as chunks, pure), ``local_store.py`` and
``local_runner.py`` (one instance), ``cluster_store.py`` and ``cluster_runner.py`` (a cluster),
``books.py`` (the API's seam over either), ``api.py``, ``metrics.py``,
``service.py`` (wired into ``extproc serve``).
"""
