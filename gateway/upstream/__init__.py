"""Talking to the replicas: the lean HTTP/1.1 client, the request as sent on (`outbound`), the
forwarders (`failover` for a plain pool, `pd` for a disaggregated one), the relay of answers
(`proxy`), by-id /v1/responses forwards, the control client (probes, scrapes, model lists) and
the translation of a replica's errors."""
