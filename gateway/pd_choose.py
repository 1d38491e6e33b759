"""The pair a disaggregated pool's request goes to: the prefill replica by the pool's policy
(prefix hit + prefill queue, over the prefill set's views), the decode replica by
`policies.pd_decode.rank_decode` (decode batch, KV headroom from the engine's
`cache_config_info` and the scraped usage). Both show in the decision header and
`/debug/decisions` (`prefill_replica`, `decode_replica`, `decode`: the picker's scores)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from policies.pd_decode import rank_decode
from policies.types import Decision

from .router import Routing

if TYPE_CHECKING:
    from .pools import Pool
    from .router import Router


@dataclass(slots=True)
class PdDecision(Decision):
    """The prefill policy's decision with the decode picker's beside it (both in explain())."""

    decode: Decision | None = None

    def explain(self) -> dict[str, object]:
        out = dict(Decision.explain(self))
        out["prefill_replica"] = self.replica
        if self.decode is not None:
            out["decode"] = dict(self.decode.explain())
            out["decode_replica"] = self.decode.replica
        return out


def choose_pair(router: Router, pool: Pool, routing: Routing) -> tuple[PdDecision, Routing]:
    """The prefill replica by the pool's policy; the decode replica by `rank_decode`."""
    assert pool.pd is not None
    pdec = router.choose(pool.pd.prefill, routing)
    decode = pool.pd.decode
    # vLLM's decode side keeps the pulled blocks in its prefix cache (it pulls only what it
    # lacks, §1.2): the index records them there too; SGLang's is not known to, so it does not
    keep = pool.pd.protocol == "vllm-nixl"
    routed = routing.routed if keep else dataclasses.replace(routing.routed, block_hashes=())
    droute = Routing(routed, routing.prompt, 0)
    now = time.monotonic()
    droute.views = [r.view(0, now) for r in decode.replicas]
    kv = {r.name: (r.engine_kv[1] if r.engine_kv else None) for r in decode.replicas}
    ddec = droute.decision = rank_decode(routed, droute.views, kv)
    both = PdDecision(
        pdec.ranked, pdec.reason, pdec.policy, pdec.scores, pdec.totals,
        {**pdec.filtered, **ddec.filtered}, pdec.predicted_hit_blocks, decode=ddec,
    )  # fmt: skip
    routing.decision = both
    return both, droute
