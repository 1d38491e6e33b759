"""The routing unit (`Router`: route = hash + match, choose = recheck + policy, dispatch) and what
it takes as inputs: the replica holding a /v1/responses follow-up (`sticky`) and the replicas'
LoRA adapters (gateway/fleet/lora.py). It decides; gateway/forwarding/ sends."""
