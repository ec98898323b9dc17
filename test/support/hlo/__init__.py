"""The graph harness: trace stand-ins and the entry points that trace, execute and shard in fresh processes."""
