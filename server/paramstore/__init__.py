"""The parameter store: W_s, its versions, merged sets, rule state, merge leases and the process's
cache of W_s, all in Redis, and the exactly-once merge transaction over them. Imports only the
vocabulary."""
