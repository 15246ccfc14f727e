"""The data-shard service: pieces of each epoch leased to workers, with exact accounting."""
