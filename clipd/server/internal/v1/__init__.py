"""Generated from proto/clipd/server/internal/v1/shard_host.proto by proto/generate.py (committed; tests/test_proto.py
checks it for drift)."""
