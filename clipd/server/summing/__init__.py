"""The summing runtime: where accepted batches are clipped and summed on this process's devices.

``devices`` (:class:`~clipd.server.summing.devices.Devices`: a device worker per JAX device, each aggregation's
shards dealt over them), ``worker`` (a device's thread: its queue, dispatch, warm-up, when to flush and
checkpoint), ``packing`` (which rows of which batches go into a step), ``slots`` (a shard's device delta and its
add into the totals), ``programs`` (the compiled steps), ``checkpoints`` (when one is due; the committer),
``batch`` (what a worker takes in) and ``memory`` (the byte budget of updates in flight, aligned buffers, giving
pages back). It sits below the RPC layer and never imports it: the RPC layer receives batches into its buffers
and hands them on; the processes that host it (:mod:`clipd.server.shards`) start and call it.
"""
