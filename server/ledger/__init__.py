"""The ledger: database models, the state machine, the parameter store and every life-cycle
procedure (claim, end, record a merge, close and release an epoch, finish a job). Imports only the
vocabulary."""
