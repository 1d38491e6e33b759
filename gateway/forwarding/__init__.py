"""Sending a routed request: the request as sent on (`outbound`), the forwarders (`failover` for a
plain pool, `pd` for a disaggregated one), the relay of answers (`relay`) and managed LoRA
placement (`lora_placement`). Routing has decided by then; forwarding sends on the transport."""
