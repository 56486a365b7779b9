"""Work generator: datasets -> shards in object storage -> workunits per epoch."""
