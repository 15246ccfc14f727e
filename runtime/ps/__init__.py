"""Parameter-server mode: sharded parameters on PS pods, workers that push and pull.

See :mod:`.api` for the user API, :mod:`.partition` for how parameters are spread
over the servers, :mod:`.server` for the PS process and :mod:`.client` for a worker's
side of the transport.
"""
