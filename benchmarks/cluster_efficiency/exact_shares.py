"""A planner variant measured and not kept: generation shares split exactly where spans overlap.

``DemandSharePlanner`` splits each group's budget (its clusters' active ranks plus the idle GPUs
they map) by weight x demand. In a CHAIN of overlapping spans (A-B-C: A and C disjoint) idle
GPUs only C reaches still count in A's quota; A's target can exceed what A can ever hold, A is
never above its target, and a pipeline sharing A's GPUs with demand but no rank waits until
A's demand falls (docs/coordinator.md, "Generation shares").

``ExactSharePlanner`` removes that: a cluster's target is capped at the ranks it can reach this
cycle, the budget is split by water-filling with caps, shared out GPU by GPU where spans
overlap, and rounded only into room left on each cluster's own GPUs, so no set of clusters is
given more ranks than its GPUs hold (first ranks aside).
``tests/unit/test_bench_exact_shares.py`` pins both the starvation it fixes and those
properties. Over seeds 1-8 it cost ours 0.8 points of GPU-h/step on long-tail 24 and 0.3-1.0
on three RollMux traces time-shared on 32 GPUs, gained 0.1-0.2 on training-heavy, and takes
1.3-1.7x the plan time (``policy_variants.py`` reproduces the margins; this module, run as a
script, the plan times), so it is not the default.

    python benchmarks/cluster_efficiency/exact_shares.py   # results/exact_shares_latency.json
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rlix_plugins.coordinator.core.planner import DemandSharePlanner, _Cycle, _Gen  # noqa: E402

#: Slack for float shares that should be whole (3 x 0.25 x 4 ranks is not exactly 3.0).
_EPS = 1e-9


@dataclass(slots=True)
class _Split:
    """Where a group's shares lie (:meth:`ExactShareCycle._contend`), in *atoms*: the sets of GPUs
    wanted by exactly the same clusters, named by small ints. Loads are per GPU of an atom
    (0 to 1)."""

    #: per cluster: its atoms, in the order its GPUs first reach them
    atoms: list[list[int]]
    #: per atom: how many clusters want its GPUs
    claimants: list[int]
    #: per atom: how many GPUs it has
    size: list[int]
    #: per cluster: its load on each GPU only it wants
    own: list[float]
    #: per cluster: its (guaranteed, other) load on each shared GPU not oversubscribed
    dense: list[tuple[float, float]]
    #: per cluster: oversubscribed atom -> its load on each GPU of that atom
    parts: list[dict[int, float]]


class ExactShareCycle(_Cycle):
    """One planning cycle of :class:`ExactSharePlanner` (only the generation targets differ)."""

    def _set_targets(self, gens: dict[str, _Gen]) -> None:
        """As :meth:`_Cycle._set_targets` (one budget per group of overlapping spans, first
        ranks guaranteed, pending requests first), but a cluster's first rank needs a rank it
        can reach, the rest is water-filled with caps (:meth:`_water_fill`), shared out GPU by
        GPU where spans overlap (:meth:`_contend`) and rounded into room left on each
        cluster's own GPUs (:meth:`_round_up`): no target above what its cluster reaches and,
        first ranks aside, no set of clusters given more ranks than their GPUs hold."""
        owner = self.owner
        # A GPU generation may use this cycle: idle, or held by a rank that may be moved
        # (not a whole-cluster holding, this cycle's grant, or a frozen pipeline's rank).
        usable = [o is None or (o.dp_rank is not None and o.cluster_id in gens) for o in owner]
        # GPU -> its atom (:class:`_Split`), for every group at once (groups map disjoint
        # GPUs, and each group's atoms start at 0: "wanted by none of its clusters").
        atom_of = [0] * len(owner)
        for group, idle in self._groups(gens):
            self._set_exact_group_targets(group, idle, usable, atom_of)

    @staticmethod
    def _reach(g: _Gen, usable: list[bool]) -> list[int]:
        """GPUs of the ranks ``g`` can hold this cycle: its active ranks and the inactive ones
        whose GPUs are all usable (whole ranks, so ``len // tp`` is its cap in ranks)."""
        tp, gpus, active = g.tp, g.gpus, g.active
        if tp == 1:
            return [x for r, x in enumerate(gpus) if usable[x] or r in active]
        out: list[int] = []
        for r in range(g.dp_size):
            rank = gpus[r * tp : r * tp + tp]
            if r in active or all(usable[x] for x in rank):
                out.extend(rank)
        return out

    def _set_exact_group_targets(
        self, group: list[_Gen], idle: int, usable: list[bool], atom_of: list[int]
    ) -> None:
        budget = idle + sum(len(g.active) * g.tp for g in group)
        order = sorted(
            group, key=lambda g: (g.pending_seq is None, g.pending_seq or 0, g.cluster_id)
        )
        reach = [self._reach(g, usable) for g in order]
        caps = [len(r) // g.tp for g, r in zip(order, reach, strict=True)]
        for g, cap in zip(order, caps, strict=True):
            g.target = 0
            if (g.pending_seq is not None or g.demand > 0) and budget >= g.tp and cap >= 1:
                g.target = 1
                budget -= g.tp
        if any(g.weight * g.demand > 0 for g in order):
            want = self._water_fill(order, caps, budget)
            share, split = self._contend(order, reach, want, atom_of)
            # Round within what the shares add up to (never above the budget): spans that
            # overlap cannot hold more ranks than that, however large the budget.
            spare = min(
                budget,
                int(sum(s * g.tp for g, s in zip(order, share, strict=True)) + _EPS)
                - sum(g.target * g.tp for g in order),
            )
            for g, s, cap in zip(order, share, caps, strict=True):
                add = max(0, min(int(s + _EPS), cap) - g.target)
                g.target += add
                spare -= add * g.tp
            if spare > 0:
                self._round_up(order, caps, share, spare, split)
        else:  # nobody's demand is known: keep what each has
            for g in order:
                g.target = max(g.target, len(g.active))
        for g in order:
            g.may_rebalance = not g.active or g.gap >= self.config.rebalance_threshold

    @staticmethod
    def _water_fill(order: list[_Gen], caps: list[int], budget: int) -> list[float]:
        """Each cluster's target (ranks, fractional) after its guaranteed rank: ``budget``
        GPUs split by weight x demand, a cluster whose share exceeds its cap gets its cap and
        the excess is split among the others, until stable (O(n log n): sorted by room per
        unit of weight, the capped ones come first)."""
        want = [float(g.target) for g in order]
        filling = sorted(
            ((cap - g.target) * g.tp / (g.weight * g.demand), i)
            for i, (g, cap) in enumerate(zip(order, caps, strict=True))
            if g.weight * g.demand > 0 and cap > g.target
        )
        left = float(budget)
        weight = sum(order[i].weight * order[i].demand for _, i in filling)
        for room_per_weight, i in filling:
            g = order[i]
            v = g.weight * g.demand
            gpus = min(room_per_weight * v, left * v / weight) if weight > 0 else 0.0
            want[i] += gpus / g.tp
            left -= gpus
            weight -= v
        return want

    @staticmethod
    def _contend(
        order: list[_Gen], reach: list[list[int]], want: list[float], atom_of: list[int]
    ) -> tuple[list[float], _Split]:
        """What each cluster's ``want`` comes to once overlapping spans share their GPUs.

        A group's budget counts GPUs only some of its clusters reach (in a chain of spans
        A-B-C, C's idle GPUs count in A's quota too), so the water-filled wants of clusters
        sharing GPUs can add up to more ranks than those GPUs hold; a donor is then never
        above its target and a pipeline with demand but no rank waits. Each cluster first
        covers its want with the GPUs only it reaches; the rest is spread evenly over its
        shared GPUs, and a shared GPU asked for more than it holds gives guaranteed first
        ranks first, then the remainder by weight x demand (water-filling over its claimants).

        GPUs wanted by the same clusters are alike, so past one pass over the GPUs (and one
        more done in C by ``Counter``) the work is per atom (:class:`_Split`): spans give few.
        """
        n = len(order)
        wanting = [i for i in range(n) if want[i] > 0]
        claimants = [0]  # atom 0: GPUs no cluster of the group wants
        for i in wanting:  # partition refinement: each cluster splits the atoms it wants
            split_to: dict[int, int] = {}
            for x in reach[i]:
                old = atom_of[x]
                new = split_to.get(old)
                if new is None:
                    new = split_to[old] = len(claimants)
                    claimants.append(claimants[old] + 1)
                atom_of[x] = new
        # Each GPU is counted once per cluster wanting it (one pass, in C).
        seen = Counter(map(atom_of.__getitem__, chain.from_iterable(reach[i] for i in wanting)))
        size = [0] * len(claimants)
        for atom, count in seen.items():
            size[atom] = count // claimants[atom]
        atoms: list[list[int]] = [[] for _ in range(n)]
        for i in wanting:
            atoms[i] = list(dict.fromkeys(map(atom_of.__getitem__, reach[i])))
        split = _Split(
            atoms, claimants, size, [0.0] * n, [(0.0, 0.0)] * n, [{} for _ in range(n)]
        )
        share = list(want)
        owns = [0] * n
        asked = [0.0] * len(claimants)  # atom -> load asked of each of its GPUs
        spread: list[int] = []  # clusters with part of their want on shared GPUs
        for i in wanting:
            g, mine = order[i], atoms[i]
            owns[i] = own = sum(size[a] for a in mine if claimants[a] == 1)
            shared = len(reach[i]) - own
            need = want[i] * g.tp - own
            if own:
                split.own[i] = min(1.0, want[i] * g.tp / own)
            if need <= _EPS or shared == 0:
                continue
            base = max(0.0, min(need, g.target * g.tp - own))
            split.dense[i] = (base / shared, (need - base) / shared)
            spread.append(i)
            d = need / shared
            for atom in mine:
                asked[atom] += d
        over: dict[int, list[int]] = {
            a: [] for a, load in enumerate(asked) if load > 1 + _EPS and claimants[a] > 1
        }
        got = [0.0] * n
        for i in spread:
            b, rest = split.dense[i]
            crowded = 0
            for atom in atoms[i]:
                if atom in over:
                    over[atom].append(i)
                    crowded += size[atom]
            got[i] = (b + rest) * (len(reach[i]) - owns[i] - crowded)
        parts, dense = split.parts, split.dense
        weights = [g.weight * g.demand for g in order]
        for atom, asking in over.items():
            base_total = sum(dense[i][0] for i in asking)
            if base_total >= 1:  # first ranks alone fill it
                for i in asking:
                    parts[i][atom] = part = dense[i][0] / base_total
                    got[i] += part * size[atom]
                continue
            left = 1 - base_total
            # the rest by weight x demand, none above what it asks (lowest ask per weight
            # first, so once one gets its fair part all later ones do)
            rest_claims = sorted(
                (dense[i][1] / weights[i], i) for i in asking if weights[i] > 0
            )
            weight = sum(weights[i] for _, i in rest_claims)
            for i in asking:
                parts[i][atom] = dense[i][0]
            for _, i in rest_claims:
                part = min(dense[i][1], left * weights[i] / weight)
                parts[i][atom] += part
                left -= part
                weight -= weights[i]
            for i in asking:
                got[i] += parts[i][atom] * size[atom]
        for i in spread:
            share[i] = (owns[i] + got[i]) / order[i].tp
        return share, split

    @staticmethod
    def _round_up(
        order: list[_Gen], caps: list[int], share: list[float], spare: int, split: _Split
    ) -> None:
        """Largest remainder, but a target rounded down is raised only into room left on its
        own GPUs once every share is rounded down: a fraction left over elsewhere (say a tp-2
        cluster's half rank) is no room for clusters that share no GPU with it."""
        claimants = split.claimants
        load = [0.0] * len(claimants)  # atom -> load on each of its GPUs
        for i, g in enumerate(order):
            s = share[i]
            if s <= 0 or not g.target:
                continue
            f = g.target / s  # its share scaled to its target, where it lies
            b, rest = split.dense[i]
            own, dense, parts = split.own[i] * f, (b + rest) * f, split.parts[i]
            for atom in split.atoms[i]:
                if claimants[atom] == 1:
                    load[atom] += own
                elif atom in parts:
                    load[atom] += parts[atom] * f
                else:
                    load[atom] += dense
        for _, i in sorted((-((s + _EPS) % 1), i) for i, s in enumerate(share)):
            g = order[i]
            if spare < g.tp or g.target + _EPS >= share[i] or g.target >= caps[i]:
                continue
            mine, size = split.atoms[i], split.size
            room = sum(max(0.0, 1 - load[a]) * size[a] for a in mine)
            if g.demand <= 0 or room + _EPS < g.tp:
                continue
            need = float(g.tp)
            for atom in mine:
                free = (1 - load[atom]) * size[atom]
                if free > 0:
                    take = min(free, need)
                    load[atom] += take / size[atom]
                    need -= take
                    if need <= 0:
                        break
            g.target += 1
            spare -= g.tp


class ExactSharePlanner(DemandSharePlanner):
    """Ours with exact shares where spans overlap (a variant, not the default)."""

    cycle_class = ExactShareCycle


def main() -> int:
    """Plan time of the variant against the default's on ``scheduler_latency``'s scales (same
    process, same states, interleaved): medians and their ratio."""
    from benchmarks.cluster_efficiency.run import RESULTS, save_results
    from benchmarks.scheduler_latency.run import SCALES, measure

    rows = []
    for pipelines, gpus in SCALES:
        base = measure(pipelines, gpus, repeats=10)
        exact = measure(pipelines, gpus, repeats=10, planner=ExactSharePlanner())
        ratio = exact.plan_ms_median / base.plan_ms_median
        rows.append({"pipelines": pipelines, "gpus": gpus, "default_ms": base.plan_ms_median,
                     "exact_shares_ms": exact.plan_ms_median, "ratio": round(ratio, 2)})
        print(f"{pipelines:5d} x {gpus:6d}: default {base.plan_ms_median:.2f} ms, exact_shares "
              f"{exact.plan_ms_median:.2f} ms ({ratio:.2f}x)")
    path = RESULTS / "exact_shares_latency.json"
    save_results({"benchmark": "exact_shares plan time", "repeats": 10, "rows": rows}, path)
    _plot(rows, path.with_suffix(".png"))
    return 0


def _plot(rows: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['pipelines']:g} x {r['gpus']:g}" for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, key in enumerate(("default_ms", "exact_shares_ms")):
        ax.bar([x + 0.4 * i for x in range(len(rows))], [r[key] for r in rows], 0.4,
               label=key.removesuffix("_ms"))
    ax.set_xticks([x + 0.2 for x in range(len(rows))], labels)
    ax.set_yscale("log")
    ax.set_xlabel("pipelines x GPUs")
    ax.set_ylabel("plan time, median (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
