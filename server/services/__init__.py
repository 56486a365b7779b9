"""The scheduler's services: dispatch, hosts, jobs, the transitioner and DeDLOC rounds, each over the ledger."""
