"""The summing runtime: where accepted batches are clipped and summed on this process's devices.

``devices`` (:class:`~clipd.server.summing.devices.Devices`: a device worker per JAX device, each aggregation's
shards dealt over them), ``worker`` (a device's queue, packing, dispatch, the add into the totals, checkpoints),
``batch`` (what a worker takes in) and ``memory`` (the byte budget of updates in flight, aligned buffers, giving
pages back). It sits below the RPC layer and never imports it: the RPC layer receives batches into its buffers
and hands them on; the processes that host it (:mod:`clipd.server.shards`) start and call it.
"""
