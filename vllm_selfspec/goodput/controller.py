"""The goodput controller: every request's draft length for the step, chosen together from the
measured costs and acceptance, and whether a step's choice is worth making at all."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from .choice import Candidate, Choice
from .costs import StepCostModel
from .safety import PlainReference, SafetyNet, SearchBudget
from .search import on_offer, search


@dataclass
class GoodputController:
    """Chooses every request's draft length together, from measured costs and acceptance."""

    costs: StepCostModel
    #: drafts must be expected to emit this share more tokens than plain decoding would in the
    #: seconds they add (a margin on the speculative part of the step, not the whole step)
    margin: float = 0.1
    #: steps without self-drafts after which one request probes (doubles while they do not pay)
    probe_every: int = 16
    max_probe_every: int = 512
    #: a kind of draft measured slower than plain pauses this long first (then doubling)
    pause: int = 32
    max_pause: int = 1024
    #: a plain cycle at least this often (a forced one where none was chosen), to keep the
    #: safety net's reference measured
    plain_every: int = 64
    _probe_turn: int = 0
    _probe_interval: int = 0
    _since_skipped_probe: int = 1 << 30  # steps since a probe was skipped as hopeless
    _free_interval: int = 0  # the same for lookup drafts
    _free_idle: int = 0  # steps since a lookup draft was chosen or probed
    _chosen_idle: int = 1 << 30  # steps since self-drafts were chosen (not probed)
    _pending: Choice | None = None
    _plain_pending: bool = False  # the last choice drafted nothing: its cycle measures plain
    #: what a choice is worth against what it costs (``look_due``): the seconds the searched
    #: choices were expected to save (decayed), and the proposer's seconds to make one (the
    #: median of the last ``LOOK_SAMPLES``)
    _look_saving: float = 0.0
    _look_cost: float | None = None
    _look_samples: list[float] = field(default_factory=list)
    _look_next: bool = True  # the last choice drafted or was not searched: the next is made
    _skipped_in_row: int = 0
    #: the last choice's per-token bar (tokens per second of a token's own cost; ``weighed``)
    _floor: float | None = None

    def __post_init__(self) -> None:
        #: self-drafting steps (paid) and lookup-only steps (free) are judged apart: a failing
        #: self-drafter must not stop free drafts, nor the other way round
        self.nets = {kind: SafetyNet(self.pause, self.max_pause) for kind in ("paid", "free")}
        self._probe_interval = self._free_interval = self.probe_every
        self.plain = PlainReference()
        self.plain_refreshes = 0  # plain cycles the controller forced
        self.skipped_probes = 0  # self-draft probes skipped: no acceptance could make them pay
        self.skipped_looks = 0  # steps whose choice was not made (``look_due``)

    @property
    def achieved(self) -> float:
        """The self-drafting steps' tokens per second over plain decoding's."""
        return self.nets["paid"].achieved

    def calibration(self) -> float:
        """The self-drafting steps' achieved/predicted extra tokens."""
        return self.nets["paid"].token_calibration()

    #: the most tokens a probe verifies (``_probe``)
    FREE_PROBE_TOKENS = 4
    #: a self-draft probe drafts as many tokens (up to ``FREE_PROBE_TOKENS``) as its draft steps
    #: fit in this share of a plain step, at least one: a probe of several tokens is what tells a
    #: verified token's cost from a verifying step's fixed cost (``_probe``)
    PAID_PROBE_SHARE = 0.25
    #: self-draft probes that fail come ever more rarely (``max_probe_every``), but never rarer
    #: than it takes for them to cost this share of the time: a cheap drafter near break-even
    #: (feature heads at 15% acceptance) is probed often enough for its estimate to recover
    #: from a few unlucky probes, at a cost no benchmark can tell from noise
    PROBE_TIME_SHARE = 0.005
    #: steps around a self-draft (after one, before a probe) in which feedback for self-drafting
    #: (DEL's shadow tokens) is worth its cost
    FEEDBACK_STEPS = 8
    #: while no self-draft has been chosen for ``FEEDBACK_STEPS`` (only probes run), costly
    #: feedback takes at most this share of the time (``feedback_share``), what the probes it
    #: prepares may take: at the search budget's 2%, DEL's shadow projections alone cost 2% of
    #: every step at batch 16 here while it drafted 4 tokens in a run, and KnapSpec's plan
    #: searches 0.3-3% at batch 1 while it drafted nothing
    IDLE_FEEDBACK_SHARE = PROBE_TIME_SHARE

    def feedback_share(self, share: float) -> float:
        """The share of the time that costly feedback for self-drafting (a ``SearchBudget`` of
        ``share``) may take now: ``share`` around self-drafts the controller chose, at most
        ``IDLE_FEEDBACK_SHARE`` while only probes run."""
        if self._chosen_idle < self.FEEDBACK_STEPS:
            return share
        return min(share, self.IDLE_FEEDBACK_SHARE)

    def feedback_allowed(self, budget: SearchBudget, search: bool = False) -> bool:
        """Whether costly feedback for self-drafting runs this step, DEL's shadow projections or
        a plan search (KnapSpec's, ``search=True``): due (``self_feedback_due``) and within
        ``budget`` at the share allowed now (``feedback_share``: the budget's own around chosen
        self-drafts, at most ``IDLE_FEEDBACK_SHARE`` while only probes run)."""
        return self.self_feedback_due(search=search) and budget.allows(
            self.feedback_share(budget.share)
        )

    def self_feedback_due(self, search: bool = False) -> bool:
        """Whether a policy's costly feedback for self-drafting (DEL's shadow projections) is
        worth it now: self-drafting ran in the last few steps, or a probe is near. A plan search
        (KnapSpec's, ``search=True``, far dearer) only before a probe, or after self-drafts that
        measured faster than plain decoding."""
        paid = self.nets["paid"]
        recent = paid.idle < self.FEEDBACK_STEPS and (not search or paid.achieved >= 1.0)
        return recent or self._probe_idle() + self.FEEDBACK_STEPS >= self._probe_interval

    # ---- whether to choose at all -------------------------------------------------------------
    #: a choice costs the proposer time of its own, drafts or not: the requests' lookups, their
    #: candidates and this search (about 2% of a plain step at batch 8 on the CPU;
    #: docs/architecture.md, "The goodput controller"); at most this many steps in a row go without one (``look_due``)
    MAX_SKIPPED_LOOKS = 3
    #: the share of the old figure kept per choice, in ``_look_saving``
    LOOK_DECAY = 0.9
    #: a choice's cost is the median of this many recent ones: a step in which the host
    #: preempted the proposer (a busy machine) must not price every later choice as dear
    LOOK_SAMPLES = 31

    def look_due(self) -> bool:
        """Whether this step's choice is worth making: the last choice drafted (drafts that pay
        come in runs: a quoted passage, a repeated pattern) or was a forced plain cycle that
        searched nothing, or choices have been expected to save at least the seconds they take
        (a decayed mean over choices, 0 for one that drafted nothing, against the median of the
        proposer's measured times to make one, ``looked``), or ``MAX_SKIPPED_LOOKS`` steps in a row went
        without one. A step without a choice drafts nothing and costs the proposer only its
        bookkeeping of the step's tokens; what it skips is a choice expected to be worth less
        than its own cost. Probes and plain refreshes come after as many choices as ever, so
        later in steps.

        Example: at batch 8 choices that draft one step in ten, each expected to save 3 ms,
        are worth 0.3 ms a choice on average; one costing 1.3 ms is then made one step in four
        after each that drafts nothing."""
        if (
            self._look_next
            or self._look_cost is None
            or self._look_saving >= self._look_cost
            or self._skipped_in_row >= self.MAX_SKIPPED_LOOKS
        ):
            self._skipped_in_row = 0
            return True
        self._skipped_in_row += 1
        self.skipped_looks += 1
        return False

    def looked(self, seconds: float) -> None:
        """The proposer's seconds to make this step's choice (its lookups, candidates, search)."""
        samples = self._look_samples
        samples.append(seconds)
        if len(samples) > self.LOOK_SAMPLES:
            del samples[0]
        self._look_cost = statistics.median(samples)

    def _searched(self, best: Choice, base: float, plain: float) -> None:
        """Record what the searched choice (before probes) is expected to save: the seconds
        plain decoding would take for its expected tokens, less its own predicted seconds."""
        saving = 0.0
        if any(best.tokens):
            saving = max(0.0, best.expected_tokens * plain / base - best.expected_seconds)
        self._look_saving += (1.0 - self.LOOK_DECAY) * (saving - self._look_saving)
        self._look_next = any(best.tokens)

    # ---- the choice ------------------------------------------------------------------------
    def choose(self, cands: list[Candidate], tokens: int | None = None) -> Choice:
        """Draft lengths maximising expected emitted tokens / predicted seconds of the next step
        (``tokens``: scheduled tokens of the step without drafts, default one per candidate)."""
        n = len(cands)
        base = float(n if tokens is None else tokens)
        line = self.costs.target_line()
        if line is None:  # no plain step measured yet: one now (drafting steps are priced over it)
            self._plain_pending = True
            return Choice([0] * n, float("nan"), float("nan"), float("nan"))
        if self.costs.draft_coefficients() is None and not all(
            c.free for c in cands if c.max_tokens
        ):
            # no draft step measured yet: one draft token per request, so its cost gets measured
            tokens = [min(1, c.max_tokens) for c in cands]
            self._plain_pending = not any(tokens)
            return Choice(tokens, float("nan"), float("nan"), float("nan"))
        # a verified draft token's seconds; a verifying step's fixed seconds (not scaled by a
        # time calibration below, though the record divides a choice's whole extra by its scale)
        v1, verify = line[2], line[3]
        plain = self.plain.seconds(line[0] + line[1] * base)  # ``target_seconds(base)``
        self.plain.since += 1
        if self.plain.since > self.plain_every:  # no plain cycle measured for a while: one now
            self.plain.since = 0
            self.plain_refreshes += 1
            self._look_next = True  # this choice searched nothing
            for net in self.nets.values():
                net.tick(False)
            self._pending, self._plain_pending = None, True
            return Choice([0] * n, float(n), plain, plain)
        paid, free = self.nets["paid"], self.nets["free"]
        scaled = [self._scaled(c, v1) for c in cands]
        # each token must pay for itself by the margin: a token near break-even adds nothing
        # but the risk of a wrong estimate, wherever the rest of the step stands
        floor = self._floor = (1.0 + self.margin) * base / plain
        # draft steps are searched only if some self-draft token clears that bar (its first is
        # its likeliest); otherwise a draft step would only add its fixed cost to the free drafts
        depth = max(
            (
                c.max_tokens
                for c in scaled
                if not c.free and c.max_tokens and self._clears_bar(c, floor, v1)
            ),
            default=0,
        )
        # the verification of m = 1.. drafts in this step, by the shapes measured or the line
        offered = on_offer(scaled, depth)
        excess = self.costs.verify_excess_table(n, offered)
        found = search(scaled, depth, base, plain, v1, floor, verify, excess, offered)
        # the depth whose set yields the most tokens per second, above plain decoding's and by
        # the margin (its token counts are built for it alone)
        best_rate, taken = n / plain, -1
        for s, (total, seconds, last) in enumerate(found.best):
            rate = total / seconds
            if last >= 0 and rate > best_rate and self._clears_margin(total, seconds, plain, base):
                best_rate, taken = rate, s
        if taken >= 0:
            best = Choice(found.tokens(taken), *found.best[taken][:2], plain)
            best.kind = self._kind(cands, best.tokens)
        else:
            best = Choice([0] * n, float(n), plain, plain)
        self._searched(best, base, plain)
        chosen_free = best.kind == "free" or (
            best.kind == "paid" and any(t and c.free for c, t in zip(cands, best.tokens))
        )
        self._since_skipped_probe += 1
        if best.kind != "paid" and paid.open and self._probe_idle() + 1 >= self._probe_interval:
            # self-drafts have not run for a while: probe, unless no self-draft could pay
            # even if every one were accepted (a probe would only cost; the next is as late);
            # once probes are as rare as they get, probe anyway: a probe also re-measures the
            # draft step's cost, which the verdict rests on. A step without a self-draft on
            # offer has nothing to probe: skipped alike
            if any(c.max_tokens > 0 and not c.free for c in cands) and (
                self._could_pay(cands, floor, v1, verify)
                or self._probe_interval >= self.max_probe_every
            ):
                best = self._probe(cands, best, plain=plain)
            else:
                self._probe_interval = min(2 * self._probe_interval, self.max_probe_every)
                self._since_skipped_probe = 0
                self.skipped_probes += 1
        if best.kind == "paid" and not best.probe:  # self-drafts chosen (not a probe)
            self._probe_interval = self.probe_every
            self._chosen_idle = 0
        else:
            self._chosen_idle += 1
        # lookup drafts likewise: an estimate that fell below the bar gets new evidence
        if chosen_free:
            self._free_idle, self._free_interval = 0, self.probe_every
        else:
            self._free_idle += 1
            if free.open and self._free_idle >= self._free_interval:
                best = self._probe(cands, best, free=True)
        if best.kind:
            best.scale = self.nets[best.kind].calibrations()[0]
        for kind, net in self.nets.items():
            net.tick(best.kind == kind)
        self._pending = best if best.kind else None
        self._plain_pending = not any(best.tokens)
        return best

    def _scaled(self, c: Candidate, v1: float) -> Candidate:
        """A candidate as the choice prices it: none of a paused kind of draft; each kind's
        estimates scaled by its record (``SafetyNet``'s calibrations)."""
        if c.max_tokens == 0:  # nothing to price
            return c
        net = self.nets["free" if c.free else "paid"]
        if not net.open or c.max_tokens < 0:
            return Candidate(0, c.accept, free=c.free)
        # the measured/predicted extra seconds scale a token's whole cost, its verification
        # (v1) included: as a row cost, so that a lookup draft's is scaled too
        t, a = net.calibrations()
        if t == 1.0 and a == 1.0:  # no record yet: the estimates as they are
            return c
        return Candidate(
            c.max_tokens,
            c.accept if a == 1.0 else [a * p for p in c.accept],
            t * c.row_seconds + (t - 1.0) * v1,
            t * c.plan_seconds,
            c.free,
        )

    def weighed(self, free: Candidate, paid: Candidate, v1: float) -> tuple[Candidate, Candidate]:
        """A request's lookup draft and its self-draft as the next choice will price them, for
        ``prefer_free`` to pick one of: each scaled (``_scaled``: none of a paused kind), and
        the self-draft dropped where its first token does not clear the last choice's per-token
        bar, so that ``choose`` would search no draft step for it. Without this a self-draft
        that the choice then cuts (a paused self-drafter, estimates measured four times too
        high, a draft step dearer than its token is worth) took the place of a lookup draft it
        would have verified."""
        free, paid = self._scaled(free, v1), self._scaled(paid, v1)
        if (
            paid.max_tokens
            and self._floor is not None
            and not self._clears_bar(paid, self._floor, v1)
        ):
            paid = Candidate(0, paid.accept)
        return free, paid

    @staticmethod
    def _clears_bar(c: Candidate, floor: float, v1: float) -> bool:
        """Whether a scaled self-draft's first token (its likeliest) yields more than ``floor``
        tokens per second of its own cost (its verification and its row of a draft step): what
        a draft step is searched for in ``choose``, and what ``weighed`` keeps a self-draft by."""
        return c.accept[0] > floor * (v1 + c.row_seconds)

    def _probe_idle(self) -> int:
        """Steps since self-drafts last ran or a probe was skipped (the probe clock)."""
        return min(self.nets["paid"].idle, self._since_skipped_probe)

    @staticmethod
    def _could_pay(cands: list[Candidate], floor: float, v1: float, verify: float = 0.0) -> bool:
        """Whether a self-draft token could clear the per-token bar (``floor`` tokens per second
        of its own cost) in the best case: accepted for sure, its draft step shared by every
        request that can self-draft. A token's cost is its verification plus its row and its
        share of the draft step and of the verifying step's fixed cost, as measured; a plan that
        costs most of a target step (LayerSkip at exit 28 of 30, say) cannot pay at any
        acceptance, so probing it is pure loss."""
        paid = [c for c in cands if c.max_tokens > 0 and not c.free]
        share = 1.0 / max(len(paid), 1)
        return any(
            1.0 > floor * (v1 + c.row_seconds + share * (c.plan_seconds + verify)) for c in paid
        )

    def _clears_margin(self, tokens: float, seconds: float, plain: float, base: float) -> bool:
        """Whether a choice's expected extra tokens beat what plain decoding would emit in its
        extra seconds by ``margin``: the margin covers errors in the *speculative* part of the
        step. (A margin on the whole step's rate would ask a lone drafting request at batch 16
        to lift the whole batch's rate by 3%, which its drafts alone cannot, so nothing would
        ever draft at large batch sizes however well it pays.)"""
        extra_seconds = seconds - plain
        extra_tokens = tokens - base
        plain_rate = base / plain
        return extra_tokens > (1.0 + self.margin) * plain_rate * extra_seconds

    @staticmethod
    def _kind(cands: list[Candidate], tokens: list[int]) -> str:
        """A choice's kind: "paid" if some drafted request self-drafts, "free" if every one
        drafts by lookup, "" if none drafts."""
        kind = ""
        for c, t in zip(cands, tokens):
            if t:
                if not c.free:
                    return "paid"
                kind = "free"
        return kind

    def _probe(
        self, cands: list[Candidate], best: Choice, free: bool = False, plain: float = 0.0
    ) -> Choice:
        """Draft tokens of one request (round robin) that the choice left out, to re-measure
        acceptance and cost; the next probe of that kind comes twice as late unless such drafts
        are chosen before it (or, for lookup drafts, this probe verifies for well under its
        price: ``settle``). With none of that kind on offer nothing is probed, and the probe
        stays due. A lookup probe (``free``) drafts the whole match, up to
        ``FREE_PROBE_TOKENS``: it costs only its verification. A self-draft probe drafts as many
        tokens as its draft steps fit in ``PAID_PROBE_SHARE`` of a ``plain`` step, at least one,
        and its probes come at least as often as ``PROBE_TIME_SHARE`` of the time pays for.
        Several tokens are what tell the cost of a verified token from a verifying step's fixed
        cost: one token at a time, noise in a few lone probes priced the step so high at batch 1
        that lookup drafts never ran again in a short engine test, and feature heads, whose draft
        step is a twentieth of a target step, drafted 2 tokens in a whole benchmark (their lone
        probes priced a verifying step at 20 ms and a verified token at 16 ms, against 0 and
        2.9 ms measured from the same engine's lookup rounds)."""
        options = [
            i for i, c in enumerate(cands) if c.max_tokens and c.free == free and not best.tokens[i]
        ]
        if not options:  # nothing of that kind on offer: the probe waits for the next step
            return best
        if free:
            self._free_interval = min(2 * self._free_interval, self.max_probe_every)
            self._free_idle = 0
        else:
            self._probe_interval = min(2 * self._probe_interval, self.max_probe_every)
        i = options[self._probe_turn % len(options)]
        self._probe_turn += 1
        tokens = list(best.tokens)
        if free:
            tokens[i] = min(cands[i].max_tokens, self.FREE_PROBE_TOKENS)
        else:
            c = cands[i]
            step = c.row_seconds + c.plan_seconds
            fit = int(self.PAID_PROBE_SHARE * plain / step) if step > 0 else self.FREE_PROBE_TOKENS
            tokens[i] = max(1, min(c.max_tokens, self.FREE_PROBE_TOKENS, fit))
            if plain > 0:  # probes a cheap drafter can afford come no rarer than they must
                seconds = tokens[i] * step + self.costs.verify_excess(len(cands), tokens[i])
                affordable = math.ceil(seconds / (self.PROBE_TIME_SHARE * plain))
                self._probe_interval = min(self._probe_interval, max(self.probe_every, affordable))
        expected = best.expected_tokens + float(sum(cands[i].accept[: tokens[i]]))
        return Choice(
            tokens,
            expected,
            float("nan"),
            best.plain_seconds,
            probe=True,
            kind=self._kind(cands, tokens),
        )

    #: a lookup probe that verified its drafts for less than this share of their price brings
    #: the next one as near as ``PROBE_TIME_SHARE`` allows (``settle``)
    STALE_PRICE_SHARE = 0.5

    # ---- what happened ---------------------------------------------------------------------
    def settle(self, emitted: int, requests: int, seconds: float) -> None:
        """The step that verified the last choice emitted ``emitted`` tokens for ``requests``
        requests, ``seconds`` of wall clock after the choice was made (its draft steps, the
        engine's cycle, the verifying forward). A choice without drafts measures plain decoding."""
        choice, self._pending = self._pending, None
        plain_cycle, self._plain_pending = self._plain_pending, False
        if choice is None and not plain_cycle:  # a step without a choice: nothing to settle
            return
        predicted = self.costs.target_seconds(requests)
        if seconds <= 0 or requests <= 0 or predicted is None or predicted <= 0:
            return
        if plain_cycle:
            self.plain.add(predicted, seconds)
        if choice is None:
            return
        plain = self.plain.seconds(predicted)
        expected = choice.expected_seconds
        if seconds > PlainReference.MAX_RATIO * max(plain, 0 if math.isnan(expected) else expected):
            return  # an idle gap in the cycle: not what the drafts cost
        self.nets[choice.kind].record(choice, emitted, requests, seconds, plain)
        if choice.probe and choice.kind == "free":
            # verified for well under its price: the price rests on samples gone stale (a slow
            # spell, one-time costs of the first verifying steps); probe again as often as
            # such probes, at what this one cost, fit in ``PROBE_TIME_SHARE`` of the time
            extra = max(seconds - plain, 0.0)
            if extra < self.STALE_PRICE_SHARE * self.costs.verify_excess(
                requests, sum(choice.tokens)
            ):
                affordable = math.ceil(extra / (self.PROBE_TIME_SHARE * plain))
                self._free_interval = min(self._free_interval, max(self.probe_every, affordable))

    def state(self) -> dict:
        nets = {
            kind: {
                "achieved": net.achieved,
                "token_calibration": net.token_calibration(),
                "time_calibration": net.time_calibration(),
                "paused": net.paused,
            }
            for kind, net in self.nets.items()
        }
        return {
            "plain_refreshes": self.plain_refreshes,
            "skipped_probes": self.skipped_probes,
            "skipped_looks": self.skipped_looks,
            "plain_overhead_s": self.plain.overhead,
            **nets,
        }
