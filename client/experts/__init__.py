"""Expert-parallel training's hosts and trainers (crowdtrain.core.experts): a host serves its experts'
forward and backward calls over HTTP (host.py), batching the calls of each expert (batching.py); a
trainer routes each input to its best experts and trains through them (mixture.py)."""
