"""The server's internal protocol: the control process's calls to its shard hosts (generated; never a client's)."""
