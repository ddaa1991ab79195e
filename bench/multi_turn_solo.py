"""Multi-turn later turns against their new tokens' prefill alone: interleaved pairs, closed loop.

With prefix caching on, a conversation's later turn finds its history cached by the earlier
turns and prefills only what is new (the previous reply's last tokens and the new question). The
question "is its TTFT close to those tokens' prefill alone?" is answered pair by pair, one
request at a time, so that load drift on a shared machine hits both sides of a pair alike:

1. the real turn (turn >= 2: the whole history plus its question): TTFT and usage.cached_tokens;
2. right after it, its *solo* twin: a cold prompt of exactly the turn's uncached length (prompt
   tokens - cached tokens), the turn's own new tokens with the first one changed
   (bench.load.closed_loop.cold_twin), so it shares no block with any cached prefix (checked:
   its cached_tokens must be 0), the same max_tokens.

Reported per pair and as medians: TTFT of each side and the ratio turn / solo. With caching off
the same conversations run without twins, to check the greedy outputs on vs off.
"""

from __future__ import annotations

from bench.load.closed_loop import cold_twin, send_one
from bench.load.workloads import Conversation
from dualpace.stats import percentile


def solo_prompt(turn_prompt_ids: list[int], num_cached_tokens: int, vocab_size: int) -> list[int]:
    """The turn's uncached tokens (at least one: an engine always computes the last prompt token),
    as a cold twin: they start a prompt of their own and their first token is changed."""
    if not 0 <= num_cached_tokens <= len(turn_prompt_ids):
        raise ValueError(f"{num_cached_tokens} cached tokens for a prompt of {len(turn_prompt_ids)}")
    start = min(num_cached_tokens, len(turn_prompt_ids) - 1)
    return cold_twin(list(turn_prompt_ids[start:]), vocab_size)


def pair_row(conversation: int, turn: int, real: dict, solo: dict) -> dict:
    """One pair's line: valid when the turn reused cached tokens, the solo twin reused none, and the
    first token of both came from the same engine (else it compares engines, not prefills)."""
    valid = (real["cached_tokens"] > 0 and solo["cached_tokens"] == 0
             and real["engines"][:1] == solo["engines"][:1])
    return {"conversation": conversation, "turn": turn, "prompt_tokens": real["prompt_tokens"],
            "cached_tokens": real["cached_tokens"], "new_tokens": solo["prompt_tokens"],
            "turn_ttft_ms": real["ttft_ms"], "solo_ttft_ms": solo["ttft_ms"],
            "solo_cached_tokens": solo["cached_tokens"], "turn_engines": real["engines"],
            "solo_engines": solo["engines"], "ratio": round(real["ttft_ms"] / solo["ttft_ms"], 3)
            if solo["ttft_ms"] > 0 else None, "valid": valid}


def solo_summary(pairs: list[dict]) -> dict:
    """Medians over the valid pairs: each side's TTFT and the per-pair ratio turn / solo."""
    valid = [p for p in pairs if p["valid"] and p["ratio"] is not None]

    def median(key: str) -> float | None:
        return round(percentile([p[key] for p in valid], 50), 3) if valid else None

    return {"num_pairs": len(pairs), "num_valid_pairs": len(valid), "turn_ttft_p50_ms": median("turn_ttft_ms"),
            "solo_ttft_p50_ms": median("solo_ttft_ms"), "ratio_p50": median("ratio"),
            "ratio_min": min((p["ratio"] for p in valid), default=None),
            "ratio_max": max((p["ratio"] for p in valid), default=None)}


def run_solo_turns(router: str, plan: list[Conversation], vocab_size: int, *, with_solo: bool, tag: str) -> dict:
    """Every conversation's turns in order, one request at a time (each turn's history the replies actually
    generated), and after each later turn its solo twin when with_solo. Returns the pairs, the
    turns' outputs by request index and the cached tokens turn 1 found (0: fresh conversations)."""
    num_turns = max((len(c.turns) for c in plan), default=0)
    pairs, outputs, first_turn_cached = [], {}, []
    for conversation in plan:
        history = list(conversation.opening_token_ids)
        for turn, (question, output_len) in enumerate(conversation.turns, start=1):
            prompt = history + list(question)
            index = 2 * (conversation.index * num_turns + turn - 1)
            real = send_one(router, index, prompt, output_len, tag)
            outputs[index] = real.pop("output_token_ids")
            history = prompt + outputs[index]
            if turn == 1:
                first_turn_cached.append(real["cached_tokens"])
            elif with_solo:
                solo = send_one(router, index + 1, solo_prompt(prompt, real["cached_tokens"], vocab_size),
                                output_len, tag)
                solo.pop("output_token_ids")
                pairs.append(pair_row(conversation.index, turn, real, solo))
    return {"pairs": pairs, "outputs": outputs, "first_turn_cached_tokens": first_turn_cached}


def solo_markdown(solo: dict) -> list[str]:
    """The pairs table and the medians, as lines of the prefix-cache report."""
    s = solo["summary"]
    lines = ["", "Multi-turn later turns vs their new tokens alone (caching on, closed loop, pairs interleaved)", "",
             "| conversation | turn | prompt tokens | cached | new tokens | turn TTFT ms | solo TTFT ms "
             "| solo cached | ratio turn/solo | engines turn / solo | valid |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in solo["pairs"]:
        lines.append(f"| {p['conversation']} | {p['turn']} | {p['prompt_tokens']} | {p['cached_tokens']} | "
                     f"{p['new_tokens']} | {p['turn_ttft_ms']} | {p['solo_ttft_ms']} | {p['solo_cached_tokens']} | "
                     f"{p['ratio']} | {'/'.join(p['turn_engines'])} / {'/'.join(p['solo_engines'])} | {p['valid']} |")
    lines += ["", f"{s['num_valid_pairs']} of {s['num_pairs']} pairs valid; medians: turn TTFT {s['turn_ttft_p50_ms']} "
                  f"ms, solo TTFT {s['solo_ttft_p50_ms']} ms, ratio turn/solo {s['ratio_p50']} "
                  f"(range {s['ratio_min']}-{s['ratio_max']}); turn 1 cached tokens {solo['first_turn_cached_tokens']}; "
                  f"outputs identical on/off: {solo.get('outputs_identical')}"]
    return lines
