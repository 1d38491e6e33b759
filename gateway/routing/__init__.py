"""The routing unit (`Router`: route = hash + match, choose = recheck + policy, dispatch) and what
it takes as inputs: the replica holding a /v1/responses follow-up (`sticky`), the replicas'
LoRA adapters (`lora`) and managed placement's offer (`lora_placement`)."""
