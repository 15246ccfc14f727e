"""What a parameter server does with its shards: updates, consistency, replicas."""
