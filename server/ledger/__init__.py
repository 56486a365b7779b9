"""The ledger: database models, the state machine and every life-cycle procedure (claim, end,
record a merge, close and release an epoch, finish a job). Imports only the vocabulary and the
parameter store (crowdtrain.server.paramstore)."""
