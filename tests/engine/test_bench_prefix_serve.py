"""The prefix-caching benchmark's accounting and text, from given responses, events and runs (no server)."""
from argparse import Namespace
from pathlib import Path

from batchtop.engine.bench import prefix_cache as pc
from batchtop.engine.bench import prefix_serve as ps
from batchtop.engine.bench.serving import RequestResult
from batchtop.telemetry import events as ev

FIXTURES = Path(__file__).parent.parent / "metrics" / "fixtures"


def test_the_prefix_counters_of_a_real_vllm_page_and_of_several_label_sets():
    assert ps.prefix_counters((FIXTURES / "vllm-0.32-busy.prom").read_text()) == (360.0, 0.0)
    page = ('vllm:prefix_cache_queries_total{engine="0"} 600.0\n'
            'vllm:prefix_cache_queries_total{engine="1"} 40\n'
            'vllm:prefix_cache_hits_total 512.0\nvllm:external_prefix_cache_hits_total 9.0\n')
    assert ps.prefix_counters(page) == (640.0, 512.0)


def result(prompt_tokens, cached=None):
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 4}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return RequestResult(success=True, prompt_len=prompt_tokens, usage=usage)


def test_prefill_from_usage_is_prompt_tokens_minus_cached_tokens():
    figures = ps.usage_figures([result(560), result(560, 512), result(540, 512), result(100, None)])
    assert figures == {"prefill": 560 + 48 + 28 + 100, "token_hit_rate": 1024 / 1760, "request_hit_rate": 0.5}


def test_prefill_and_hits_from_batchtop_events_count_first_admissions_only():
    def admitted(rid, known, cached, resumed=False):
        return ev.RequestAdmitted(step=1, t=0.0, request_id=rid, slot=0, num_computed_tokens=cached,
                                  resumed=resumed, num_known_tokens=known, num_cached_tokens=cached)

    def chunk(rid, n):
        return ev.PrefillChunk(step=1, t=0.0, request_id=rid, num_tokens=n, num_computed_tokens=n,
                               num_known_tokens=n)
    events = [admitted("a", 560, 0), chunk("a", 560), admitted("b", 550, 512), chunk("b", 38),
              admitted("b", 560, 544, resumed=True), chunk("b", 16)]
    assert ps.event_figures(events) == {"prefill": 614, "token_hit_rate": 512 / 1110, "request_hit_rate": 0.5}


def args(**kw):
    return Namespace(**{"rounds": 2, "model": "smollm2", "max_num_seqs": 32, "num_prompts": 8,
                        "prefix_len": 500, "suffix_len": 48, "output_len": 32, "eager": True,
                        "vllm_omp_threads": 1,
                        "argv": ["--vllm"], **kw})


def engine_run(ttft, tput):
    return {"prefill": 1000, "ttft_p50": ttft, "ttft_p99": ttft * 2, "out_tok_s": tput, "hit_rate": 0.5,
            "failed": 0}


def serve_run(ttft, tput):
    return {"prefill": 900, "metrics_prefill": 900, "token_hit_rate": 0.8, "request_hit_rate": 0.88,
            "ttft_p50": ttft, "ttft_p99": ttft * 2, "out_tok_s": tput, "failed": 0}


def test_the_section_keeps_the_on_off_verdicts_and_gives_a_serving_verdict_only_beyond_the_spread():
    runs = {("shared", True): [engine_run(100, 50), engine_run(110, 52)],
            ("shared", False): [engine_run(300, 40), engine_run(320, 41)],
            ("no prefix", True): [engine_run(300, 40), engine_run(300, 44)],
            ("no prefix", False): [engine_run(300, 41), engine_run(300, 43)]}
    serve = {("shared", "batchtop serve"): [serve_run(100, 50), serve_run(104, 51)],
             ("shared", "vLLM"): [serve_run(200, 50), serve_run(210, 60)],
             ("no prefix", "batchtop serve"): [serve_run(300, 40), serve_run(300, 40)],
             ("no prefix", "vLLM"): [serve_run(310, 41), serve_run(300, 39)]}
    text = pc.section(args(), runs, serve, "0.32.0")
    assert "TTFT p50 off / on per round 3.0x, 2.9x: **met**" in text
    assert "within the spread: no throughput lost" in text
    assert "batchtop serve vs vLLM 0.32.0" in text
    assert "31 blocks of 16 (batchtop caches 496 of them) or 3 blocks of 128 (vLLM caches 384)" in text
    assert ("| shared | vLLM | 900 (900), 900 (900) | 200, 210 | 410 | 50.0, 60.0 | 55.0 | 0.800 | 0.88 |"
            in text)
    shared = next(line for line in text.splitlines() if line.startswith("Shared trace, batchtop"))
    assert "TTFT p50 -50% of vLLM's" in shared and "**batchtop better**" in shared
    assert "output tok/s -8% of vLLM's (rounds spread by up to 18%: within it, no verdict)" in shared
    assert pc.section(args(), runs).count("batchtop serve") == 0
    assert "`python -m batchtop.engine.bench.prefix_cache --vllm`" in text


def test_one_round_gives_no_verdict_on_a_difference():
    runs = {(trace, on): [engine_run(100 if on and trace == "shared" else 300, 40 if on else 50)]
            for trace in ("shared", "no prefix") for on in (True, False)}
    serve = {(trace, name): [serve_run(100 if name == "vLLM" else 300, 40)]
             for trace in ("shared", "no prefix") for name in ("batchtop serve", "vLLM")}
    text = pc.section(args(rounds=1), runs, serve, "0.32.0")
    assert "not resolved: one round measures no spread" in text
    assert "(one round: no spread measured, no verdict)" in text
    assert "**batchtop better" not in text and "**batchtop worse" not in text


def test_without_a_vllm_environment_the_leg_is_skipped_with_a_line(monkeypatch, capsys):
    monkeypatch.setattr("batchtop.engine.vllm.launch.vllm_available", lambda: "no vLLM environment at /x")
    monkeypatch.setattr(pc, "run", lambda a: {})
    monkeypatch.setattr(pc, "section", lambda a, runs, serve, version: f"{pc.SECTION}\n{serve}")
    assert pc.main(["--vllm", "--no-write"]) == 0
    assert "the vLLM leg is skipped: no vLLM environment at /x" in capsys.readouterr().err
