"""Engine against stock llama-cpp-python on the same GGUF: the ground truth."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgemoe.errors import ContextOverflowError
from edgemoe.runtime.engine import ChatMessage, ChatSession, Engine, LoadConfig
from edgemoe.runtime.sampling import GREEDY, SamplingParams

from helpers.stock import stock_greedy

PROMPT = "ROMEO:\nWhat light through yonder window"
ARCH_PRESETS = ["tiny-qwen3moe", "tiny-mixtral", "tiny-qwen2moe", "tiny-deepseek2", "tiny-olmoe", "tiny-gpt-oss",
                "tiny-llama-dense"]


def _engine_greedy(path: Path, prompt: str, n: int) -> tuple[list[int], list[int]]:
    with Engine(path, LoadConfig(n_ctx=512, n_threads=2)) as eng:
        assert eng.flash_attn == "on"  # "auto" on the CPU backend, as stock_greedy runs it
        g = eng.generate(prompt, max_tokens=n, sampling=GREEDY)
        return g.prompt_tokens, g.tokens


def test_greedy_equals_stock_on_fixtures(fixture_model: Path) -> None:
    ours = _engine_greedy(fixture_model, PROMPT, 48)
    stock = stock_greedy(fixture_model, PROMPT, 48)
    assert ours[0] == stock[0]  # same prompt ids, BOS as the metadata says
    assert ours[1] == stock[1]
    assert len(ours[1]) >= 1


@pytest.mark.parametrize("preset", ARCH_PRESETS)
def test_greedy_equals_stock_on_architectures(preset: str, make_tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    path = make_tiny_gguf(preset)
    ours = _engine_greedy(path, "hello world, the quick brown fox", 24)
    stock = stock_greedy(path, "hello world, the quick brown fox", 24)
    assert ours == stock


def test_bos_follows_metadata(fixture_model: Path) -> None:
    import gguf

    r = gguf.GGUFReader(str(fixture_model))
    field = r.get_field(gguf.Keys.Tokenizer.ADD_BOS)
    add_bos = bool(field.contents()) if field is not None else False
    bos = int(r.get_field(gguf.Keys.Tokenizer.BOS_ID).contents())
    with Engine(fixture_model, LoadConfig(n_ctx=128)) as eng:
        ids = eng.tokenize("hello")
        assert (ids[0] == bos) == add_bos


def test_stream_matches_generate_and_prefix_reuse(fixture_model: Path) -> None:
    with Engine(fixture_model, LoadConfig(n_ctx=512)) as eng:
        pieces = [p for _, p in eng.stream(PROMPT, max_tokens=24, sampling=GREEDY)]
        first = eng.last
        assert "".join(pieces) == first.text
        # same prompt again: the KV prefix is reused, the result must not change
        second = eng.generate(PROMPT, max_tokens=24, sampling=GREEDY)
        assert second.tokens == first.tokens
        assert second.timings.prompt_tokens == 1  # only the last prompt token was re-evaluated
        # a different continuation then the original prompt again
        eng.generate(PROMPT + " and", max_tokens=4, sampling=GREEDY)
        assert eng.generate(PROMPT, max_tokens=24, sampling=GREEDY).tokens == first.tokens


def test_logits_match_stock(fixture_model: Path) -> None:
    import llama_cpp

    with Engine(fixture_model, LoadConfig(n_ctx=256, n_batch=256, n_ubatch=256)) as eng:
        ids = eng.tokenize(PROMPT)
        ours = np.array(eng.eval_logits(ids))
    llm = llama_cpp.Llama(model_path=str(fixture_model), n_ctx=256, n_batch=256, logits_all=True, flash_attn=True,
                          n_threads=2, verbose=False)
    llm.eval(ids)
    stock = np.array(llm.scores[:len(ids)])
    llm.close()
    assert np.array_equal(ours, stock)  # same library, same batch: bitwise


def test_seeded_sampling_is_reproducible(fixture_model: Path) -> None:
    sp = SamplingParams(temperature=0.9, seed=42)
    with Engine(fixture_model, LoadConfig(n_ctx=256)) as eng:
        a = eng.generate(PROMPT, max_tokens=16, sampling=sp).tokens
        eng.reset()
        b = eng.generate(PROMPT, max_tokens=16, sampling=sp).tokens
    assert a == b


def test_repeat_penalty_equals_stock(fixture_model: Path) -> None:
    """--repeat-penalty (llama.cpp's penalties sampler) runs and penalises like stock llama-cpp-python."""
    import llama_cpp

    sp = SamplingParams(temperature=0.0, repeat_penalty=1.5)
    with Engine(fixture_model, LoadConfig(n_ctx=256)) as eng:
        got = eng.generate(PROMPT, max_tokens=48, sampling=sp, ignore_eog=True).tokens
        plain = eng.generate(PROMPT, max_tokens=48, sampling=GREEDY, ignore_eog=True).tokens
        ids = eng.tokenize(PROMPT)
    llm = llama_cpp.Llama(model_path=str(fixture_model), n_ctx=256, flash_attn=True, verbose=False)
    gen = llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.5, penalize_nl=True)
    ref = [next(gen) for _ in range(48)]
    gen.close()
    llm.close()
    assert got != plain and got == ref


def test_chat_template_and_session(fixture_model: Path) -> None:
    with Engine(fixture_model, LoadConfig(n_ctx=512)) as eng:
        text = eng.format_chat([ChatMessage("user", "Hi")])
        assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        chat = ChatSession(eng)
        reply1 = "".join(chat.send("To be, or not to be", max_tokens=32, sampling=GREEDY))
        assert eng.last.stop_reason in ("eog", "length")
        reply2 = "".join(chat.send("Say more", max_tokens=16, sampling=GREEDY))
        assert [m.role for m in chat.history] == ["user", "assistant", "user", "assistant"]
        assert chat.history[1].content == reply1.strip() and chat.history[3].content == reply2.strip()
        # the second turn reused the first turn's KV cache
        assert eng.last.timings.prompt_tokens < len(eng.last.prompt_tokens)
        chat.reset()
        assert chat.history == []


def test_prompt_longer_than_context(fixture_model: Path) -> None:
    with Engine(fixture_model, LoadConfig(n_ctx=256)) as eng:
        assert eng.n_ctx == 256
        with pytest.raises(ContextOverflowError, match="context holds 256"):
            eng.generate("word " * 400, max_tokens=4)
        # the engine is still usable afterwards
        assert eng.generate("hello", max_tokens=2, sampling=GREEDY).tokens


def test_generation_stops_at_context_end(fixture_model: Path) -> None:
    with Engine(fixture_model, LoadConfig(n_ctx=256)) as eng:
        ids = eng.tokenize(PROMPT)
        g = eng.generate(PROMPT, max_tokens=500, sampling=GREEDY, ignore_eog=True)
        assert g.stop_reason == "context"
        assert len(ids) + len(g.tokens) == eng.n_ctx + 1  # the last sampled token is not decoded


def test_closed_engine_and_bad_values_raise_instead_of_crashing(fixture_model: Path) -> None:
    from edgemoe.errors import EdgeMoeError, EngineClosedError

    eng = Engine(fixture_model, LoadConfig(n_ctx=128))
    with pytest.raises(EdgeMoeError, match="not in the vocabulary"):
        eng.token_piece(-1)
    with pytest.raises(EdgeMoeError, match="not in the vocabulary"):
        eng.detokenize([10**6])
    eng.close()
    eng.close()  # twice is fine
    for call in (lambda: eng.generate("hi", max_tokens=2), lambda: eng.tokenize("hi"), lambda: eng.format_chat([]),
                 lambda: eng.set_policies(None), lambda: eng.reset(), lambda: eng.control_stats()):
        with pytest.raises(EngineClosedError, match="closed"):
            call()
    for cfg in (LoadConfig(expert_used_count=100), LoadConfig(expert_used_count=0), LoadConfig(expert_used_count=-1),
                LoadConfig(n_threads=100000), LoadConfig(n_batch=0)):
        with pytest.raises(EdgeMoeError):
            Engine(fixture_model, cfg)


def test_chat_session_trims_oldest_turns_and_refuses_a_message_alone_too_long(fixture_model: Path) -> None:
    with Engine(fixture_model, LoadConfig(n_ctx=256)) as eng:
        chat = ChatSession(eng)
        for i in range(6):
            list(chat.send(f"message {i}: " + "tell me more about the library " * 4, max_tokens=24,
                           sampling=GREEDY))
            n = len(eng.tokenize(eng.format_chat(chat.messages()), parse_special=True))
            assert n <= eng.n_ctx
        assert chat.dropped_turns > 0
        assert chat.history[0].role == "user" and chat.history[-1].role == "assistant"
        assert chat.history[-2].content.startswith("message 5")
        before = list(chat.history)
        with pytest.raises(ContextOverflowError, match="raise `n_ctx`"):
            list(chat.send("word " * 2000, max_tokens=8, sampling=GREEDY))
        assert chat.history == before


def test_two_threads_on_one_engine_get_busy_errors_not_a_crash(fixture_model: Path) -> None:
    import threading

    from edgemoe.errors import EngineBusyError

    with Engine(fixture_model, LoadConfig(n_ctx=512)) as eng:
        want = eng.generate(PROMPT, max_tokens=16, sampling=GREEDY).tokens
        got: list[list[int]] = []
        busy: list[EngineBusyError] = []

        def work() -> None:
            for _ in range(8):
                try:
                    got.append(eng.generate(PROMPT, max_tokens=16, sampling=GREEDY).tokens)
                except EngineBusyError as err:
                    busy.append(err)

        threads = [threading.Thread(target=work) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(got) + len(busy) == 16 and got and all(g == want for g in got)
    assert all("another thread" in str(e) for e in busy)


def test_close_inside_a_hook_is_refused_and_the_engine_still_works(fixture_model: Path) -> None:
    from edgemoe.errors import EngineBusyError

    class Closer:
        wants_probs = wants_gate_inp = False

        def __init__(self, eng: Engine) -> None:
            self.eng = eng

        def on_route(self, route: object) -> None:
            self.eng.close()

    with Engine(fixture_model, LoadConfig(n_ctx=256)) as eng:
        eng.set_policies([Closer(eng)])  # type: ignore[list-item]
        with pytest.raises(EngineBusyError, match="routing hook"):
            eng.generate(PROMPT, max_tokens=4, sampling=GREEDY)
        eng.set_policies(None)
        assert len(eng.generate(PROMPT, max_tokens=4, sampling=GREEDY).tokens) == 4


def test_close_with_a_stream_left_open_then_the_stream_says_closed(fixture_model: Path) -> None:
    from edgemoe.errors import EngineClosedError

    eng = Engine(fixture_model, LoadConfig(n_ctx=256))
    stream = eng.stream(PROMPT, max_tokens=8, sampling=GREEDY)
    next(stream)
    eng.close()
    with pytest.raises(EngineClosedError):
        next(stream)
