"""The pair engine (Study 1, "Donor pair"): :func:`run_pairs` answers every arm of several items'
donor pairs at once — tokenize with position budgets, prefill in batched rounds sharing each
item's common prefix, serve, one batched readout per question — and scores each arm as a donor
pair; :func:`run_pair` is one item. A probe asks the engine with :class:`PairRequest`\\ s and gets
back one :class:`PairRun` per request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, cast

from eventkv.errors import EventKVError
from eventkv.kv.log import TokenizedLog, tokenize_query
from eventkv.kv.model import takes_4d_masks
from eventkv.kv.readout import read_out
from eventkv.kv.rows import EventKV
from eventkv.kv.serve import ServedCache
from eventkv.probes.base import Runtime
from eventkv.studies.materialization.pairs.arms import PairArm, events_read, served_ids
from eventkv.studies.materialization.pairs.prefill import PrefillCache, leading_log, shared_log, tokenize_pair
from eventkv.studies.materialization.pairs.scoring import donor_d, outcome
from eventkv.studies.materialization.pairs.serve import encode_isolated, isolated_events, leading_rows, serve_arm

#: one served cache of a batch: ``(item, arm name, variants it answers, served cache)``
Entry = tuple[int, str, tuple[int, ...], ServedCache]


@dataclass(frozen=True)
class PairRequest:
    """What one item asks of the pair engine (the first phase of a pair probe's item).

    Attributes:
        pair: the donor pair to answer, the engine's input (see the package docstring:
            ``values``, ``histories``, ``roles``, ``pad``, ``questions``, ``candidates``,
            ``gold_candidates``).
        parse: reads the answer out of a generated text (None: no answer).
    """

    pair: dict
    parse: Callable[[str], str | None]


@dataclass
class PairRun:
    """One item answered on every arm by :func:`run_pair`: what a probe writes its record from.

    Attributes:
        logs: per history, the two variants' TokenizedLogs ``[A, B]`` (shared positions).
        prefills: per history, the two variants' EventKVs ``[A, B]``: rows of the global prefill, up to
            the last event an arm reads (lazy prefill; every event when an arm reads all).
        answers: per arm, ``[out_A, out_B]``: ``text``, ``n_tokens`` (``stopped``), ``answer``
            (generate) and ``logprobs`` (nats), ``choice`` (logits).
        outcomes: per arm and readout, the pair's outcome (:func:`outcome`).
        d: per arm with the logits readout, the donor statistic (:func:`donor_d`, nats).
        query_position: per arm, the position of the query's first token.
        served: per arm, ``events`` (event ids, or ``"all"``), ``swap`` (event ids whose rows
            come from the other variant) and ``rows`` (header + served rows, per variant).
    """

    logs: dict[str, list[TokenizedLog]]
    prefills: dict[str, list[EventKV]]
    answers: dict[str, list[dict]]
    outcomes: dict[str, dict[str, str]]
    d: dict[str, float]
    query_position: dict[str, int]
    served: dict[str, dict]

    @property
    def history_end(self) -> dict[str, int]:
        """Per history, the first position after it (where a query starts; the same in both variants)."""
        return {h: pair[0].history_end for h, pair in self.logs.items()}

    def record(self) -> dict:
        """The engine's part of a contract probe's record: ``{"arms": {arm: {"A": out, "B": out}},
        "outcomes", "d", "query_position", "history_end", "served"}``."""
        return {
            "arms": {n: {"A": x[0], "B": x[1]} for n, x in self.answers.items()},
            "outcomes": self.outcomes,
            "d": self.d,
            "query_position": self.query_position,
            "history_end": self.history_end,
            "served": self.served,
        }


def run_pair(
    rt: Runtime,
    item: dict,
    arms: Sequence[PairArm],
    *,
    instruction: str,
    readouts: Sequence[str],
    parse: Callable[[str], str | None],
    max_new_tokens: int,
    answer_prefix: str,
    cache: PrefillCache | None = None,
    shared_prefix: bool = False,
    record_stopped: bool = False,
    whole: bool = False,
    prompt_lookup: bool = False,
) -> PairRun:
    """Run every arm on both variants of one item and score each arm as a donor pair (Study 1,
    "Donor pair"): the one donor-pair engine of the pair probes. One batched readout answers all
    arms of a question. **Lazy prefill**: each history is prefilled up to the last event
    a subset-serving arm reads, and continued to its end only when an arm reads every event (text,
    or ``served="all"``); rows are causal and the query's position comes from the log, so an arm's
    rows and answers are byte-identical whether or not another arm asked for the whole history.

    Args:
        item: the item (see the package docstring).
        arms: the arms to answer; an isolated arm whose served tokens are the same in both
            variants is encoded once and answers both.
        readouts: ``generate`` and/or ``logits``.
        parse: reads the answer out of a generated text (None: no answer).
        max_new_tokens: the greedy generation budget (tokens).
        answer_prefix: text forced before the scored candidates (e.g. ``"Answer:"``).
        cache: prefills to continue (default: a new :class:`PrefillCache`).
        shared_prefix: prefill each history's common leading events once as their own prefix
            before the variants (:meth:`PrefillCache.prefill_shared`) instead of continuing
            variant A's rows; the donor-pair probe's order of forwards, kept so its records stay
            bitwise the same.
        record_stopped: record ``stopped`` (the generation ended on a stop token) per answer.
        whole: prefill every history to its end even when no arm reads past the lead (the lead is
            still computed first, so the answers are byte-identical to the lazy run's).
        prompt_lookup: greedy answers draft from the text of the events their arm serves and the question
            (:class:`eventkv.kv.decoding.PromptLookup`): the same answers up to the rounding of a
            forward of several tokens, in fewer decode forwards where an answer quotes the history.

    Returns:
        a :class:`PairRun` (its :meth:`PairRun.record` is the contract probes' record part).

    Raises:
        EventKVError: an arm naming an unknown history, role or question; a history or query
            beyond the model's context.
    """
    return run_pairs(
        rt,
        [item],
        arms,
        instruction=instruction,
        readouts=readouts,
        parses=[parse],
        max_new_tokens=max_new_tokens,
        answer_prefix=answer_prefix,
        caches=None if cache is None else [cache],
        shared_prefix=shared_prefix,
        record_stopped=record_stopped,
        whole=whole,
        prompt_lookup=prompt_lookup,
    )[0]


def run_pairs(
    rt: Runtime,
    items: Sequence[dict],
    arms: Sequence[PairArm],
    *,
    instruction: str,
    readouts: Sequence[str],
    parses: Sequence[Callable[[str], str | None]],
    max_new_tokens: int,
    answer_prefix: str,
    caches: Sequence[PrefillCache] | None = None,
    shared_prefix: bool = False,
    record_stopped: bool = False,
    whole: bool = False,
    prompt_lookup: bool = False,
) -> list[PairRun]:
    """:func:`run_pair` on several items at once: the
    items' prefills run in rounds, each round of every item in one :func:`eventkv.kv.batched.prefill_batch`
    forward (the shared events; both variants' leads, which continue them — with ``shared_prefix``,
    else variant A's lead and then B's, which continues A's rows; then the rest of each history when
    an arm reads everything); every event an isolated arm serves is encoded alone after the header —
    taken from its prefill when it is a history's first event, else packed into the first round's
    forward under a 4D mask (:func:`eventkv.kv.batched.prefill_packed`; a forward of its own,
    :func:`eventkv.kv.batched.encode_alone`, for a model that takes no 4D mask); and the served caches
    of every item are read out together, one :func:`read_out` per question and query length (caches are
    left-padded, each with its own positions; no padding goes between a cache's rows and its query). :func:`run_pair` is
    this function on one item; with more, the records equal one item's at a time up to float
    rounding (the matmuls run at other shapes; tested on tiny models).

    Args:
        items: the items (see the package docstring).
        parses: one answer parser per item.
        caches: one :class:`PrefillCache` per item (default: new ones).
        arms, instruction, readouts, max_new_tokens, answer_prefix, shared_prefix, record_stopped,
            whole, prompt_lookup: as for :func:`run_pair`, the same for every item.

    Returns:
        one :class:`PairRun` per item, in order.

    Raises:
        EventKVError: as :func:`run_pair`; ``parses`` or ``caches`` not one per item.
    """
    if len(parses) != len(items) or (caches is not None and len(caches) != len(items)):
        raise EventKVError(
            f"run_pairs got {len(items)} items but {len(parses)} parsers"
            + ("" if caches is None else f" and {len(caches)} prefill caches")
            + ": give one per item."
        )
    caches = list(caches) if caches is not None else [PrefillCache(rt, instruction) for _ in items]
    used = sorted({a.history for a in arms})
    logs, jobs = _plan_prefills(rt, items, arms, used, instruction, shared_prefix, whole)
    memo = _IsolatedMemo(rt, instruction, isolated_events(items, arms, logs))
    # the planned rounds prefill both variants of every used history: no None is left
    ekvs = cast(
        "list[dict[str, list[EventKV]]]",
        _prefill_rounds(rt, caches, jobs, [{h: [None, None] for h in used} for _ in items], memo),
    )
    memo.finish(ekvs)
    entries: list[Entry] = []
    served_rec: list[dict] = [{} for _ in items]
    qpos: list[dict] = [{} for _ in items]
    for i, item in enumerate(items):
        common = max(logs[i][h][0].history_end for h in used)
        for arm in arms:
            caches_i, qpos[i][arm.name], served_rec[i][arm.name] = serve_arm(
                rt, item, arm, logs[i][arm.history], ekvs[i][arm.history], common, memo
            )
            entries += [(i, arm.name, vs, sc) for vs, sc in caches_i]
    results = _read_out_entries(
        rt, items, arms, entries, readouts, max_new_tokens, answer_prefix, logs if prompt_lookup else None
    )
    # every arm serves both variants of its item (one cache each, or one for both): no None is left
    answers = cast("list[dict[str, list[dict]]]", _answers(items, arms, entries, results, parses, record_stopped))
    runs = []
    for i, item in enumerate(items):
        outcomes, d = _score(item, arms, answers[i], readouts)
        runs.append(PairRun(logs[i], ekvs[i], answers[i], outcomes, d, qpos[i], served_rec[i]))
    return runs


def _plan_prefills(
    rt: Runtime,
    items: Sequence[dict],
    arms: Sequence[PairArm],
    used: Sequence[str],
    instruction: str,
    shared_prefix: bool,
    whole: bool,
) -> tuple[list[dict[str, list[TokenizedLog]]], list[list[list[tuple[str, TokenizedLog]]]]]:
    """Per item, the two variants' TokenizedLogs of every history an arm answers from, and its
    prefills in rounds (``[(what, log)]`` per round; ``what`` is ``"shared"`` or
    ``"<history>/<variant>"``): the prefills of one round do not continue each other.

    Raises:
        EventKVError: an arm history the item does not have.
    """
    logs: list[dict[str, list[TokenizedLog]]] = []
    jobs: list[list[list[tuple[str, TokenizedLog]]]] = []
    for item in items:
        logs.append({})
        jobs.append([])
        for h in used:
            if h not in item["histories"]:
                raise EventKVError(f"arm history {h!r} is not in the item (has {', '.join(item['histories'])}).")
            logs[-1][h] = pair = tokenize_pair(rt, instruction, item["histories"][h], item.get("pad", {}).get(h))
            n, everything = events_read(arms, item, pair[0], h)
            everything = everything or whole
            lead = pair if n is None else [leading_log(log, n) for log in pair]
            shared = shared_log(lead) if shared_prefix else None
            variants = [[(f"{h}/0", lead[0])], [(f"{h}/1", lead[1])]]
            if shared is not None:  # both variants continue the shared events: one round
                jobs[-1] += [[("shared", shared)], variants[0] + variants[1]]
            else:  # variant B continues variant A's rows up to their first difference
                jobs[-1] += variants
            if everything and n is not None:  # the rest continues the lead: the lead's rows are the same either way
                jobs[-1].append([(f"{h}/0", pair[0]), (f"{h}/1", pair[1])])
    return logs, jobs


class _IsolatedMemo(dict):
    """The ``isolated_memo`` of a batch (:func:`eventkv.kv.serve.serve`'s: rows keyed by event id, first
    position and token ids) and how each event an isolated arm serves gets its rows, cheapest first:

    1. an event right after the header is its prefill's own rows (:func:`leading_rows`);
    2. the others ride in the first prefill round's forward (``pending``, taken by :func:`_prefill_rounds`,
       which packs them with :func:`eventkv.kv.batched.prefill_packed`) when the model takes a 4D mask;
    3. whatever is left (no 4D mask, or no round computed anything) is encoded in a forward of its own
       (:func:`encode_isolated`) by :meth:`finish`.
    """

    def __init__(self, rt: Runtime, instruction: str, wanted: dict[tuple, tuple[int, list[int], int]]) -> None:
        super().__init__()
        self.rt, self.instruction, self.wanted = rt, instruction, wanted
        h = len(rt.header_ids(instruction))
        self.pending = {k: w for k, w in wanted.items() if k[1] != h} if wanted and takes_4d_masks(rt.model) else {}

    def finish(self, ekvs: Sequence[dict[str, list[EventKV]]]) -> None:
        """Fill in every wanted event the prefill rounds did not encode (steps 1 and 3 above)."""
        for k, (i, _, _) in self.wanted.items():
            if k not in self:
                rows = leading_rows(k, [e for pair in ekvs[i].values() for e in pair])
                if rows is not None:
                    self[k] = rows
        self.update(encode_isolated(self.rt, self.instruction, {k: w for k, w in self.wanted.items() if k not in self}))


def _prefill_rounds(
    rt: Runtime,
    caches: Sequence[PrefillCache],
    jobs: list[list[list[tuple[str, TokenizedLog]]]],
    ekvs: list[dict[str, list[EventKV | None]]],
    memo: _IsolatedMemo | None = None,
) -> list[dict[str, list[EventKV | None]]]:
    """Run the planned prefills round by round, each round of every item in one
    :func:`eventkv.kv.batched.prefill_batch` forward (a prefill an item's cache already holds is
    reused); fills and returns ``ekvs`` (per item and history, the variants' latest EventKVs). The first
    round that computes anything also encodes ``memo``'s pending isolated events
    (:func:`eventkv.kv.batched.prefill_packed`), longest first, each in the row that is then the shortest,
    and puts their rows in ``memo``."""
    from eventkv.kv.batched import prefill_packed

    for r in range(max(len(j) for j in jobs)):
        todo: list[tuple[int, str, TokenizedLog, EventKV]] = []
        done: list[tuple[int, str, EventKV]] = []
        for i, item_jobs in enumerate(jobs):
            for what, log in item_jobs[r] if r < len(item_jobs) else ():
                have, prefix = caches[i].plan(log)
                if have is not None:
                    done.append((i, what, have))
                else:
                    todo.append((i, what, log, prefix))
        if todo:
            alone: list[tuple[int, list[int], int]] = []
            keys: list[tuple] = []
            if memo is not None and memo.pending:
                width = [log.n_rows - prefix.n_rows for _, _, log, prefix in todo]
                for k, (_, tokens, first) in sorted(memo.pending.items(), key=lambda kw: -len(kw[1][1])):
                    row = width.index(min(width))
                    width[row] += len(tokens)
                    alone.append((row, tokens, first))
                    keys.append(k)
                memo.pending = {}
            made, isolated = prefill_packed(
                rt.model,
                [(log, prefix) for _, _, log, prefix in todo],
                alone,
                max_context=rt.max_context,
                weights_digest=rt.weights_digest,
            )
            if memo is not None:
                memo.update(zip(keys, isolated))
            done += [(i, what, caches[i].add(ekv)) for (i, what, _, _), ekv in zip(todo, made)]
        for i, what, ekv in done:
            if what != "shared":
                h, v = what.split("/")
                ekvs[i][h][int(v)] = ekv
    return ekvs


def _read_out_entries(
    rt: Runtime,
    items: Sequence[dict],
    arms: Sequence[PairArm],
    entries: Sequence[Entry],
    readouts: Sequence[str],
    max_new_tokens: int,
    answer_prefix: str,
    lookup_logs: Sequence[dict[str, list[TokenizedLog]]] | None = None,
) -> list:
    """The readout of every served cache, in ``entries`` order: one :func:`read_out` per question,
    query length and candidate list over all items; given ``lookup_logs`` (per item, the histories'
    TokenizedLogs), each cache's greedy answer drafts from the token ids of the events its arm serves (every
    event for text), as its rows hold them, and its question.

    Raises:
        EventKVError: an arm's question the item does not have.
    """
    cand_texts = [list(item["candidates"]) for item in items]
    cands = [[rt.encode(" " + c) for c in texts] for texts in cand_texts]
    groups: dict[tuple, list[int]] = {}
    queries: dict[tuple[int, str], list[int]] = {}
    for k, (i, name, _, _) in enumerate(entries):
        q = next(a for a in arms if a.name == name).question
        if q not in items[i]["questions"]:
            raise EventKVError(f"question {q!r} is not in the item (has {', '.join(items[i]['questions'])}).")
        if (i, q) not in queries:
            queries[i, q] = tokenize_query(rt.tokenizer, rt.profile, items[i]["questions"][q])
        key = (q, len(queries[i, q]), tuple(cand_texts[i]), tuple(map(tuple, cands[i])))
        groups.setdefault(key, []).append(k)
    sources: dict[tuple[int, str, int], list[int]] = {}  # (item, arm, variant) -> its served events' token ids

    def source(k: int, q: str) -> list[int]:
        """The served events' token ids (in history order) and the question's: an arm that serves the same
        events in both variants drafts the same tokens in both, so a control stays bitwise the same across them."""
        assert lookup_logs is not None
        i, name, vs, _ = entries[k]
        if (i, name, vs[0]) not in sources:
            arm = next(a for a in arms if a.name == name)
            log = lookup_logs[i][arm.history][vs[0]]
            ids = set(log.event_ids if arm.encoding == "prefill" else served_ids(items[i], arm, log))
            sources[i, name, vs[0]] = [t for e, toks in zip(log.event_ids, log.event_tokens) if e in ids for t in toks]
        return sources[i, name, vs[0]] + queries[i, q]

    results: list = [None] * len(entries)
    for (q, _, texts, cand_ids), ks in groups.items():
        res = read_out(
            rt.model,
            [entries[k][3] for k in ks],
            [queries[entries[k][0], q] for k in ks],
            generate=["generate" in readouts] * len(ks),
            score=["logits" in readouts] * len(ks),
            candidates=[list(c) for c in cand_ids],
            candidate_texts=list(texts),
            answer_prefix_ids=rt.encode(answer_prefix),
            max_new_tokens=max_new_tokens,
            stop_token_ids=rt.stop_token_ids,
            tokenizer=rt.tokenizer,
            max_context=rt.max_context,
            lookup=[source(k, q) for k in ks] if lookup_logs is not None else None,
        )
        for k, x in zip(ks, res):
            results[k] = x
    return results


def _answers(
    items: Sequence[dict],
    arms: Sequence[PairArm],
    entries: Sequence[Entry],
    results: Sequence,
    parses: Sequence[Callable[[str], str | None]],
    record_stopped: bool,
) -> list[dict[str, list[dict | None]]]:
    """Per item and arm, ``[out_A, out_B]`` from the readouts (see :attr:`PairRun.answers`); a
    cache that answers both variants gives both the same ``out``."""
    answers: list[dict[str, list[dict | None]]] = [{a.name: [None, None] for a in arms} for _ in items]
    for (i, name, vs, _), res in zip(entries, results):
        out: dict = {}
        if res.generation is not None:
            g = res.generation
            out.update(text=g.text, n_tokens=len(g.tokens))
            if record_stopped:
                out.update(stopped=g.stopped)
            out.update(answer=parses[i](g.text))
        if res.candidates:
            lps: dict[str, float] = {}
            for c in res.candidates:  # candidates that tokenize alike keep the first score
                lps.setdefault(c.text, c.logprob)
            out.update(logprobs=lps, choice=max(lps, key=lps.__getitem__))
        for v in vs:
            answers[i][name][v] = out
    return answers


def _score(
    item: dict, arms: Sequence[PairArm], answers: dict[str, list[dict]], readouts: Sequence[str]
) -> tuple[dict[str, dict[str, str]], dict[str, float]]:
    """Each arm of one item scored as a donor pair: per arm and readout its :func:`outcome`, and
    per arm with the logits readout its :func:`donor_d` (0.0 when the gold candidates coincide or
    only one candidate was scored)."""
    a, b = item["values"]
    ca, cb = item.get("gold_candidates", item["values"])
    outcomes: dict[str, dict[str, str]] = {}
    d: dict[str, float] = {}
    for arm in arms:
        A, B = answers[arm.name]
        outcomes[arm.name] = {}
        if "generate" in readouts:
            outcomes[arm.name]["generate"] = outcome(A["answer"], B["answer"], a, b)
        if "logits" in readouts:
            outcomes[arm.name]["logits"] = outcome(A["choice"], B["choice"], ca, cb)
            d[arm.name] = donor_d(A["logprobs"], B["logprobs"], ca, cb) if ca != cb and len(A["logprobs"]) > 1 else 0.0
    return outcomes, d
