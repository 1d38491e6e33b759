"""The route receipt: the prompt tokens the gateway predicted cached on the replica it chose,
beside the tokens the engine says it reused (`usage.prompt_tokens_details.cached_tokens`).

Both are in the engine's tokens and whole engine blocks, so they compare like for like:

- tokens mode hashes the engine's own token ids: the prediction is the index's hit in tokens;
- bytes mode hashes the rendered prompt's bytes: its hit is a share of the prompt, turned into
  engine tokens with this request's own count (the answer's `usage.prompt_tokens`). The hit ends
  at a whole index block, and where the prompts really part lies somewhere in the next one: half
  a block more is the expected place (without it every bytes-mode prediction runs short by half
  an index block on average, and by two engine blocks at worst);
- an engine caches whole blocks only, and never the prompt's last token (it must compute it):
  the prediction is cut to `prompt - 1` tokens, then down to a multiple of the engine's block
  (its `cache_config_info`, else the index's block).

A receipt is cold when neither expected a hit (a first request: nothing predicted, nothing
reused), exact when the two agree on a hit, within one block when they differ by at most one
engine block (a boundary token merged differently, a partial block), else over (the gateway
expected a hit the engine did not have: the request paid a prefill it was not routed for) or
under (the engine reused more than the index knew: a hit the routing could not count on). It is
unreported when the engine said nothing of cached tokens (vLLM without
`--enable-prompt-tokens-details`, an engine that has no such field): then nothing is judged.
"""

from __future__ import annotations

from dataclasses import dataclass

VERDICTS = ("cold", "exact", "within_block", "over", "under", "unreported")
# predicted - reported, in tokens: a block or two either way, then whole prompts' worth
ERROR_BUCKETS = (
    -16384, -4096, -1024, -256, -64, -32, -16, -1, 0, 16, 32, 64, 256, 1024, 4096, 16384,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Receipt:
    predicted: int  # engine tokens the gateway expected the replica to reuse
    reported: int | None  # engine tokens the replica reported reused; None: it did not say
    block: int  # the engine's block in tokens: the tolerance

    @property
    def error(self) -> int | None:
        """Predicted less reported, in tokens; None when the engine did not report."""
        return None if self.reported is None else self.predicted - self.reported

    @property
    def verdict(self) -> str:
        reported = self.reported
        if reported is None:
            return "unreported"
        err = self.predicted - reported
        if err == 0:
            return "exact" if reported else "cold"
        if abs(err) <= self.block:
            return "within_block"
        return "over" if err > 0 else "under"


def receipt(
    hit_tokens: int,
    estimated_prompt: int,
    reported_prompt: int | None,
    reported_cached: int | None,
    block: int,
    bytes_block: float | None,
) -> Receipt:
    """The receipt of one served request (`unreported` when the engine did not report cached
    tokens).

    `hit_tokens`: the index's hit on the replica that served, in the gateway's tokens (bytes
    mode: its estimate, `estimated_prompt` being the prompt's); `block`: the engine's block;
    `bytes_block`: bytes mode's index block in estimated tokens (None: tokens mode).
    """
    predicted = float(hit_tokens)
    if reported_prompt:
        if bytes_block is not None and estimated_prompt > 0:
            if 0 < hit_tokens < estimated_prompt:
                predicted += bytes_block / 2
            predicted = predicted * reported_prompt / estimated_prompt
        predicted = min(predicted, reported_prompt - 1)
    block = max(1, block)
    return Receipt(int(predicted) // block * block, reported_cached, block)
