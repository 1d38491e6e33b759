"""HTTP/1.1 on the wire, both ways, and nothing about routing: the lean upstream client and its
response, the control client (probes, scrapes, model lists, adapter loads), the translation of a
replica's errors; the server side's uvicorn protocol with the limits it lacks, its delays, and
the one response writer every answer leaves through."""
