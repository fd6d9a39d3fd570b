"""Rollouts from the captured prompt state (`trl_longstraw/rollout.py`) against transformers' `generate`."""

import pytest
import torch
from transformers import GenerationConfig

from trl_longstraw import LongStrawGRPOTrainer
from trl_longstraw.accounting import prompt_state_account
from trl_longstraw.embedded import FAMILIES, build_model
from trl_longstraw.engine import LongStrawEngine, prepare_model
from trl_longstraw.rollout import (
    PromptRows,
    ToolTurnStates,
    UnsupportedRolloutError,
    check_generation_config,
    decode,
    prepare_sampling,
)
from trl_longstraw.state.suffix import SUFFIX_PAGE_TOKENS, Suffix

from .conftest import GROUP_SIZE, TINY_PAGED_CACHE, make_trainer

PAD, EOS = 0, 1


def generation_config(**settings) -> GenerationConfig:
    fields = {
        "max_new_tokens": 10,
        "do_sample": False,
        "pad_token_id": PAD,
        "eos_token_id": [EOS],
        "disable_compile": True,
    }
    fields.update(settings)
    return GenerationConfig(**fields)


def left_padded(
    prompts: list[torch.Tensor], rows_per_prompt: int, pad: int = PAD
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    rows = [p for p in prompts for _ in range(rows_per_prompt)]
    ids = torch.stack([torch.cat([torch.full((width - len(p),), pad), p]) for p in rows])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p)), torch.ones(len(p))]).long() for p in rows])
    return ids, mask


def rollout(model, prompts, rows_per_prompt, config, step_logits=None, chunk=8):
    """Capture each prompt once and decode its rows from the state, as the trainer does."""
    prepare_model(model)
    engine = LongStrawEngine(prefill_chunk_size=chunk, attention_chunk_size=chunk)
    padded, mask = left_padded(prompts, rows_per_prompt, config.pad_token_id)
    groups = [
        PromptRows(list(range(i * rows_per_prompt, (i + 1) * rows_per_prompt)), p, engine.capture(model, p, 0))
        for i, p in enumerate(prompts)
    ]
    sampling = prepare_sampling(model, config, padded, mask)
    return decode(engine, model, groups, padded, sampling, step_logits), groups


def generate(model, prompts, rows_per_prompt, config):
    ids, mask = left_padded(prompts, rows_per_prompt, config.pad_token_id)
    out = model.generate(
        input_ids=ids, attention_mask=mask, generation_config=config, output_logits=True, return_dict_in_generate=True
    )
    return out.sequences[:, ids.shape[1] :], out.logits


def random_prompts(model, lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    return [torch.randint(2, vocab, (n,), generator=generator) for n in lengths]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_rollout_is_token_identical_to_generate_with_its_logits(family):
    model = build_model(family, seed=0).float()
    prompts = random_prompts(model, [23])
    want_tokens, want_logits = generate(model, prompts, 3, generation_config())
    logits = []
    tokens, _ = rollout(model, prompts, 3, generation_config(), logits)
    assert torch.equal(tokens, want_tokens)
    assert len(logits) == len(want_logits)
    assert max(float((got - want).abs().max()) for got, want in zip(logits, want_logits, strict=True)) < 1e-5


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "glm_moe_dsa"])
def test_seeded_sampling_draws_what_generate_draws_across_padded_prompts(family):
    """Two prompts of different lengths (left padding), every sampling knob on: same seed, same completions."""
    model = build_model(family, seed=0).float()
    prompts = random_prompts(model, [17, 9], seed=1)
    config = generation_config(
        do_sample=True, temperature=0.9, top_p=0.95, top_k=40, min_p=0.01, repetition_penalty=1.3, max_new_tokens=12
    )
    torch.manual_seed(5)
    want, _ = generate(model, prompts, GROUP_SIZE, config)
    torch.manual_seed(5)
    got, _ = rollout(model, prompts, GROUP_SIZE, config)
    assert torch.equal(got, want)
    assert len(set(map(tuple, got.tolist()))) > 1  # sampling, not a greedy echo


def test_the_repetition_penalty_skips_left_padding_as_generate_does():
    """Padding with a token the short prompt's row would emit (the pad token is often the EOS token): `generate`
    does not penalise a row's padding, so neither may the rollout."""
    model = build_model("qwen3", seed=0).float()
    prompts = random_prompts(model, [20, 8], seed=1)
    free, _ = generate(model, prompts, 1, generation_config(eos_token_id=[], repetition_penalty=1.3))
    pad = int(free[1, 0])  # what the short, left-padded prompt's row emits first
    assert pad not in prompts[1].tolist()
    config = generation_config(eos_token_id=[], pad_token_id=pad, repetition_penalty=1.3)
    want, _ = generate(model, prompts, 1, config)
    got, _ = rollout(model, prompts, 1, config)
    assert torch.equal(got, want)


def test_rows_stop_at_eos_and_are_padded_after_it_as_generate_does():
    model = build_model("qwen3", seed=0).float()
    prompts = random_prompts(model, [15, 11], seed=2)
    free, _ = generate(model, prompts, 2, generation_config(eos_token_id=[]))
    eos = int(free[0, 3])  # a token row 0 emits at step 3: rows stop at different steps
    config = generation_config(eos_token_id=[eos])
    want, _ = generate(model, prompts, 2, config)
    got, _ = rollout(model, prompts, 2, config)
    assert torch.equal(got, want)
    assert (got == eos).any() and got.shape[1] <= free.shape[1]


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "gpt_oss"])
def test_decoding_leaves_the_prompt_state_untouched(family):
    """Single-token kernels update recurrent states in place: they must write the rows' copies, not the prompt's."""
    model = build_model(family, seed=0).float()
    prompts = random_prompts(model, [21])
    prepare_model(model)
    state = LongStrawEngine(8, 8).capture(model, prompts[0], 0)
    before = [t.clone() for t in state.tensors()]
    engine = LongStrawEngine(8, 8)
    padded, _ = left_padded(prompts, 3)
    decode(
        engine,
        model,
        [PromptRows([0, 1, 2], prompts[0], state)],
        padded,
        prepare_sampling(model, generation_config(), padded, torch.ones_like(padded)),
    )
    assert all(torch.equal(a, b) for a, b in zip(before, state.tensors(), strict=True))


def test_a_max_length_the_prompt_fills_is_refused_as_generate_refuses_it():
    """No `max_new_tokens` and a `max_length` the padded prompts already reach: generate's own error, not a rollout
    with no room."""
    model = build_model("qwen3", seed=0).float()
    padded, _ = left_padded(random_prompts(model, [12]), 2)
    config = generation_config(max_new_tokens=None, max_length=12)
    with pytest.raises(ValueError, match="Input length of input_ids is 12, but `max_length` is set to 12"):
        prepare_sampling(model, config, padded, torch.ones_like(padded))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "glm_moe_dsa", "gemma3_text", "gpt_oss"])
def test_decode_memory_is_one_prompt_state_plus_a_suffix_per_row(family):
    """Suffix bytes = rows x (capacity x per-token bytes + fixed windowed and recurrent bytes) for a capacity within
    one page (`test_a_suffix_grows_with_what_its_rows_decoded_not_to_its_capacity`: beyond), from the state
    accounting (`account.bytes(capacity)`, the accounting's decoded row): what G adds is the rows' own decoded tokens
    (a sliding window's last `window - 1` of them), never another copy of the prompt."""
    model = build_model(family, seed=0).float()
    prompts = random_prompts(model, [19])
    account = prompt_state_account(model.config, dtype_bytes=4)
    fixed = sum(a.layers * a.fixed for a in account.by_layer_type.values())
    for rows in (2, 5):
        prepare_model(model)
        engine = LongStrawEngine(8, 8)
        state = engine.capture(model, prompts[0], 0)
        suffix = Suffix(rows, capacity=10, first_position=state.num_tokens)
        tokens = prompts[0][-1:].expand(rows, 1)
        for _ in range(8):  # past the tiny configs' window of 6: a windowed layer keeps 5 entries
            engine.decode(model, state, suffix, tokens)
        assert suffix.nbytes() == rows * (10 * account.bytes_per_token() + fixed) == rows * account.bytes(10)


def test_a_suffix_grows_by_pages_and_copies_nothing():
    """A long rollout's entries are kept in pages (`SUFFIX_PAGE_TOKENS`), allocated as the rows reach them: a decode
    step adds at most one page (bounded memory per step, whatever the length), never the capacity up front, no entry
    is ever copied (every page keeps its storage from its first write on), and the entries read back as written."""
    rows, width, steps = 2, 4, 3000
    suffix = Suffix(rows, capacity=1_000_000, first_position=0)
    owner, storages, page_bytes = object(), [], rows * SUFFIX_PAGE_TOKENS * width * 4
    for step in range(steps):
        held = suffix.nbytes()
        blocks = suffix.extend(owner, "key", torch.full((rows, 1, width), float(step)), dim=1)
        suffix.advance(1)
        assert suffix.nbytes() - held in (0, page_bytes)  # at most one new page per step
        assert suffix.nbytes() <= page_bytes * -(-suffix.length // SUFFIX_PAGE_TOKENS)
        pointers = [block.untyped_storage().data_ptr() for block in blocks]
        assert pointers[: len(storages)] == storages  # earlier pages never move
        storages = pointers
    assert torch.equal(torch.cat(blocks, dim=1)[1, :, 3], torch.arange(steps, dtype=torch.float32))
    assert [block.shape[1] for block in blocks] == [SUFFIX_PAGE_TOKENS] * (steps // SUFFIX_PAGE_TOKENS) + [
        steps % SUFFIX_PAGE_TOKENS
    ]


@pytest.mark.parametrize("family", ["qwen3", "glm_moe_dsa", "deepseek_v3", "gpt_oss"])
def test_rows_decoding_past_several_suffix_pages_decode_generates_tokens(family, monkeypatch):
    """Suffix pages of 4 tokens over 14 decoded tokens, and rows fed 9 tokens on top of their prompt's state in one
    forward (a write across pages): attention reads every page as a block (K/V, MLA latents), a DSA indexer (top-12
    of up to 44 keys, so the selection matters) scores the last page with the forward's own keys and the earlier
    pages block by block; tokens and logits as `generate`'s."""
    monkeypatch.setattr("trl_longstraw.state.suffix.SUFFIX_PAGE_TOKENS", 4)
    dsa = {"index_topk": 12, "index_n_heads": 32} if family == "glm_moe_dsa" else {}
    model = build_model(family, seed=0, **dsa).float()
    prompts = random_prompts(model, [23])
    # token 0's embedding is zero: a DSA query after it scores every key 0, a tie any two top-k may break differently
    config = generation_config(max_new_tokens=14, suppress_tokens=[PAD])
    want_tokens, want_logits = generate(model, prompts, 2, config)
    logits = []
    tokens, _ = rollout(model, prompts, 2, config, logits)
    assert torch.equal(tokens, want_tokens)
    assert max(float((got - want).abs().max()) for got, want in zip(logits, want_logits, strict=True)) < 1e-5
    (tokens, logits), (want_tokens, want_logits) = continued_rows(model, config, "fed")
    assert torch.equal(tokens, want_tokens)
    assert max(float((got - want).abs().max()) for got, want in zip(logits, want_logits, strict=True)) < 1e-5


def test_trainer_captures_each_prompt_once_per_step_on_policy(tokenizer, prompt_dataset, tmp_path):
    """Generation, scoring and the update read one capture per prompt: one group per step, one capture."""
    model = build_model("qwen3", seed=0)
    trainer = make_trainer(
        LongStrawGRPOTrainer,
        model,
        tokenizer,
        prompt_dataset,
        tmp_path,
        per_device_train_batch_size=GROUP_SIZE,
        max_steps=2,
    )
    assert trainer.rollout_from_prompt_state
    trainer.train()
    steps = [log for log in trainer.state.log_history if "longstraw/rollout/count" in log]
    assert len(steps) == 2
    assert all(log["longstraw/capture/count"] == 1 for log in steps)
    assert all(log["longstraw/rollout/count"] == 1 for log in steps)


def test_generation_settings_a_rollout_cannot_serve_fall_back_or_are_refused(tokenizer, prompt_dataset, tmp_path):
    beams = {"generation_kwargs": {"num_beams": 2}}
    trainer = make_trainer(LongStrawGRPOTrainer, build_model("qwen3"), tokenizer, prompt_dataset, tmp_path, **beams)
    assert not trainer.rollout_from_prompt_state  # the default falls back to generate
    with pytest.raises(UnsupportedRolloutError, match="rollout_from_prompt_state=False"):
        make_trainer(
            LongStrawGRPOTrainer,
            build_model("qwen3"),
            tokenizer,
            prompt_dataset,
            tmp_path,
            rollout_from_prompt_state=True,
            **beams,
        )


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"token_healing": True}, "token_healing=True"),
        ({"cache_implementation": "quantized"}, "cache_implementation='quantized'"),
        ({"guidance_scale": 1.5}, "guidance_scale=1.5"),
        ({"num_return_sequences": 2}, "num_return_sequences=2"),
        ({"do_sample": False, "num_beams": 2}, "beam search"),
    ],
)
def test_generation_settings_that_change_what_generate_samples_are_not_ignored(setting, message):
    model = build_model("qwen3")
    with pytest.raises(UnsupportedRolloutError, match=message):
        check_generation_config(model, GenerationConfig(**{"do_sample": True, **setting}))


@pytest.mark.parametrize(
    "generator",
    ["use_vllm", "use_transformers_continuous_batching", "use_transformers_paged"],  # the last: an alias
)
def test_rollout_and_another_generator_are_one_generator_too_many(generator):
    from trl_longstraw import LongStrawGRPOConfig

    with pytest.raises(ValueError, match=f"rollout_from_prompt_state=True with {generator}=True"):
        LongStrawGRPOConfig(output_dir="unused", rollout_from_prompt_state=True, **{generator: True})


@pytest.mark.parametrize("setting", ["host_state", "fp8_pages"])
def test_decoding_reads_host_resident_and_fp8_prompt_states(setting):
    """The rollout reads the state through the same placement and dequantisation as scoring: host-resident state
    decodes exactly as device state; fp8 pages decode within their quantisation error (compared while both decoded
    the same tokens: a greedy flip changes every later input)."""
    model = build_model("qwen3", seed=0).float()
    prompts = random_prompts(model, [150], seed=3)
    prepare_model(model)
    padded, _ = left_padded(prompts, 2)
    settings = {"state_device": torch.device("cpu")}
    if setting == "fp8_pages":
        settings = {"prompt_state_dtype": "float8_e4m3fn"}
    runs = {}
    for name, engine in (("plain", LongStrawEngine(64, 64)), (setting, LongStrawEngine(64, 64, **settings))):
        state = engine.capture(model, prompts[0], 0)
        steps = []
        sampling = prepare_sampling(model, generation_config(), padded, torch.ones_like(padded))
        tokens = decode(engine, model, [PromptRows([0, 1], prompts[0], state)], padded, sampling, steps)
        runs[name] = (tokens, torch.stack(steps))
    (tokens, logits), (plain_tokens, plain_logits) = runs[setting], runs["plain"]
    if setting == "host_state":
        assert torch.equal(tokens, plain_tokens) and torch.equal(logits, plain_logits)
        return
    width = min(tokens.shape[1], plain_tokens.shape[1])
    differs = (tokens[:, :width] != plain_tokens[:, :width]).any(dim=0).nonzero()
    same_inputs = int(differs[0]) + 1 if len(differs) else width  # logits of step k read tokens < k
    error = float((logits[:same_inputs] - plain_logits[:same_inputs]).abs().max())
    assert same_inputs >= 3 and 0.0 < error < 0.02


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "nemotron_h", "glm_moe_dsa"])
def test_a_one_token_prompt_decodes_from_an_empty_state_as_generate_does(family):
    """A one-token prompt captures nothing: its rows decode from an empty state (beside a padded 5-token prompt)."""
    model = build_model(family, seed=0).float()
    prompts = random_prompts(model, [1, 5], seed=4)
    want_tokens, want_logits = generate(model, prompts, 2, generation_config())
    logits = []
    tokens, groups = rollout(model, prompts, 2, generation_config(), logits)
    assert groups[0].state.num_tokens == 0
    assert torch.equal(tokens, want_tokens)
    assert max(float((got - want).abs().max()) for got, want in zip(logits, want_logits, strict=True)) < 1e-5


def continued_rows(model, config, how, seed=6):
    """A tool turn's batch: two rows continuing one captured prompt with the same tokens, two with their own (of
    different lengths), and two rows of another prompt with no continuation; decoded from the states and by
    `generate` over the rows' whole left-padded histories. `how`: "extended", each continuing row's tokens captured
    into a continuation of the prompt's state (`LongStrawEngine.extend`; the last row's in two turns, the second
    continuing the first), or "fed" on top of it in the first forward (`PromptRows.continuation`)."""
    prompt, other, *continuations = random_prompts(model, [19, 11, 9, 1, 4], seed=seed)
    histories = [torch.cat([prompt, c]) for c in (continuations[0], *continuations)] + [other, other]
    torch.manual_seed(5)
    want_tokens, want_logits = generate(model, histories, 1, config)
    prepare_model(model)
    engine = LongStrawEngine(8, 8)
    state = engine.capture(model, prompt, 0)
    if how == "fed":
        rows = [PromptRows([0, 1], prompt, state, continuations[0])]
        rows += [PromptRows([row], prompt, state, c) for row, c in zip((2, 3), continuations[1:], strict=True)]
    else:
        rows = []
        for row_ids, continuation, turns in zip(([0, 1], [2], [3]), continuations, (1, 1, 2), strict=True):
            history = torch.cat([prompt, continuation])
            turn = state
            for added in history[len(prompt) - 1 : -1].tensor_split(turns):  # the prompt's last token on, but the last
                turn = engine.extend(model, turn, added)
            assert turn.geometry.first_index + turn.num_tokens == len(history) - 1
            rows.append(PromptRows(row_ids, history, turn))
    rows.append(PromptRows([4, 5], other, engine.capture(model, other, 0)))
    padded, mask = left_padded(histories, 1)
    logits = []
    torch.manual_seed(5)
    tokens = decode(engine, model, rows, padded, prepare_sampling(model, config, padded, mask), logits)
    return (tokens, logits), (want_tokens, want_logits)


@pytest.mark.parametrize("how", ["extended", "fed"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_rows_continuing_a_prompt_decode_as_generate_does_from_their_whole_history(family, how):
    """Greedy, past the tiny configs' sliding window of 6: `generate`'s tokens and logits."""
    model = build_model(family, seed=0).float()
    (tokens, logits), (want_tokens, want_logits) = continued_rows(model, generation_config(), how)
    assert torch.equal(tokens, want_tokens)
    assert max(float((got - want).abs().max()) for got, want in zip(logits, want_logits, strict=True)) < 1e-5


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "glm_moe_dsa"])
def test_continued_rows_draw_what_generate_draws(family):
    model = build_model(family, seed=0).float()
    config = generation_config(do_sample=True, temperature=0.9, top_k=40, repetition_penalty=1.3, max_new_tokens=12)
    (tokens, _), (want_tokens, _) = continued_rows(model, config, "extended")
    assert torch.equal(tokens, want_tokens)
    assert len(set(map(tuple, tokens.tolist()))) > 2


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "glm_moe_dsa"])
def test_tool_turn_rows_extend_their_kept_rows_and_share_what_they_added_alike(family):
    """Two turns of a tool loop by hand: rows extend the kept row their history starts with, the span two rows added
    alike captured once (each going on from it), a row of a prompt never kept is captured; the next turn extends the
    rows of this one. Every turn decodes `generate`'s tokens and logits over the rows' whole histories."""
    model = build_model(family, seed=0).float()
    prompt, other, shared, *tails = random_prompts(model, [12, 9, 5, 3, 4, 6, 2, 3], seed=3)
    prepare_model(model)
    engine = LongStrawEngine(8, 8)
    captured = []

    def capture(index, rows, prompt_ids):
        captured.append(len(prompt_ids))
        return engine.capture(model, prompt_ids, 0)

    def extend(state, tokens):
        extended.append(len(tokens))
        return engine.extend(model, state, tokens)

    turns = ToolTurnStates()
    turns.keep({tuple(prompt.tolist()): PromptRows([0, 1, 2], prompt, engine.capture(model, prompt, 0))})
    extended = []

    def turn(histories):
        """One turn's rows and decoded tokens, checked against `generate`."""
        extended.clear()
        rows_of = {tuple(history.tolist()): [row] for row, history in enumerate(histories)}
        rows = turns.prompt_rows(rows_of, capture, extend, torch.device("cpu"), shared_span_tokens=3)
        config = generation_config(max_new_tokens=4)
        torch.manual_seed(5)
        want_tokens, want_logits = generate(model, histories, 1, config)
        padded, mask = left_padded(histories, 1)
        logits = []
        torch.manual_seed(5)
        tokens = decode(engine, model, rows, padded, prepare_sampling(model, config, padded, mask), logits)
        assert torch.equal(tokens, want_tokens)
        assert max(float((got - want).abs().max()) for got, want in zip(logits, want_logits, strict=True)) < 1e-5
        return rows, tokens

    histories = [torch.cat([prompt, shared, tails[0]]), torch.cat([prompt, shared, tails[1]])]
    histories += [torch.cat([prompt, tails[2]]), other]
    first, tokens = turn(histories)
    # the span (the prompt's last token and `shared`) once, then each row's own tokens but its last
    assert extended == [1 + len(shared), len(tails[0]) - 1, len(tails[1]) - 1, len(tails[2])]
    assert first[0].state.parent is first[1].state.parent is not first[2].state.parent
    assert captured == [len(other)]
    additions = [tokens[row, :2].tolist() + [7, 8] for row in range(3)]  # decoded tokens, then a tool's output
    second, _ = turn([torch.cat([histories[row], torch.tensor(additions[row])]) for row in range(3)])
    assert extended == [len(added) for added in additions]  # what each row added since its last turn, no more
    assert all(entry.state.parent is previous.state for entry, previous in zip(second, first[:3], strict=True))
    turns.release()


def test_tool_turns_decode_from_the_first_turns_capture(tmp_path, monkeypatch):
    """GRPOTrainer's tool loop calls the generation again with each row's prompt, completion and tool results: each
    row extends the state its last turn left (one prompt capture per step, the first turn's; a turn captures only the
    row's tokens since its last turn), and each turn's first logits are the model's over the row's whole history."""
    from datasets import Dataset

    import trl_longstraw.trainer as trainer_module
    from trl_longstraw.embedded import add, build_tool_calling_model, build_tool_calling_tokenizer

    tokenizer = build_tool_calling_tokenizer()
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "add one and two"}]] * 4})
    errors = []

    def checked_decode(engine, model, prompts, padded, sampling):
        step_logits = []
        tokens = decode(engine, model, prompts, padded, sampling, step_logits)
        for entry in prompts:
            if entry.state.parent is not None:
                assert entry.continuation is None
                row = entry.rows[0]
                history = padded[row][padded[row] != tokenizer.pad_token_id]  # as GRPOTrainer passed it
                assert torch.equal(entry.prompt_ids, history)
                parent = entry.state.parent
                assert entry.state.num_tokens == len(history) - 1 - parent.geometry.first_index - parent.num_tokens
                with torch.no_grad():
                    want = model(history[None]).logits[0, -1]
                errors.append(float((step_logits[0][row] - want).abs().max()))
        return tokens

    monkeypatch.setattr(trainer_module, "decode", checked_decode)
    trainer = make_trainer(
        LongStrawGRPOTrainer,
        build_tool_calling_model(tokenizer),
        tokenizer,
        dataset,
        tmp_path,
        tools=[add],
        per_device_train_batch_size=GROUP_SIZE,
        max_completion_length=96,
        max_steps=2,
    )
    trainer.train()
    steps = [log for log in trainer.state.log_history if "longstraw/capture/count" in log]
    assert len(steps) == 2 and all(log["longstraw/capture/count"] == 1 for log in steps)
    assert len(errors) >= 2 and max(errors) < 1e-5, errors
    assert not trainer._tool_turns.in_tool_loop  # the prompts kept for the tool turns are released with the generation


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_trls_continuous_batching_generates_with_the_models_own_attention(family, tokenizer, prompt_dataset, tmp_path):
    """transformers' continuous batching accepts attention implementations by name: TRL's generation runs with the
    model's own (SDPA, or eager for attention sinks), and LongStraw's is back for scoring and the update."""
    trainer = make_trainer(
        LongStrawGRPOTrainer,
        build_model(family, seed=0),
        tokenizer,
        prompt_dataset,
        tmp_path,
        per_device_train_batch_size=GROUP_SIZE,
        max_steps=1,
        use_transformers_continuous_batching=True,
        transformers_continuous_batching_config=TINY_PAGED_CACHE,
    )
    assert not trainer.rollout_from_prompt_state
    trainer.train()
    assert trainer.model.config._attn_implementation == "longstraw"
    assert trainer.state.log_history[0]["longstraw/capture/count"] >= 1


def replaced_generate(calls):
    """A `generate` of the test's own: three fixed tokens after every row (the last one EOS)."""

    def generate(*args, input_ids=None, **kwargs):
        calls.append(input_ids.shape[0])
        completion = torch.tensor([5, 6, EOS], device=input_ids.device).expand(input_ids.shape[0], -1)
        return torch.cat([input_ids, completion], dim=1)

    return generate


@pytest.mark.parametrize("where", ["instance", "GenerationMixin"])
def test_a_replaced_generate_generates_as_in_grpo_trainer(where, tokenizer, prompt_dataset, tmp_path, monkeypatch):
    """A rollout from the prompt state reproduces transformers' generate; a model whose generate was replaced (on the
    instance, or `GenerationMixin.generate` patched, as GRPOTrainer's own tests do) generates with it instead."""
    from transformers import GenerationMixin

    trainer = make_trainer(LongStrawGRPOTrainer, build_model(), tokenizer, prompt_dataset, tmp_path, max_steps=1)
    calls = []
    generate = replaced_generate(calls)
    if where == "instance":
        monkeypatch.setattr(trainer.model, "generate", generate, raising=False)
    else:
        monkeypatch.setattr(GenerationMixin, "generate", lambda self, *args, **kwargs: generate(*args, **kwargs))
    trainer.train()
    assert calls
    assert trainer.state.log_history[0]["completions/mean_length"] == 3


def test_a_replaced_generate_with_rollout_from_prompt_state_true_is_refused(
    tokenizer, prompt_dataset, tmp_path, monkeypatch
):
    trainer = make_trainer(
        LongStrawGRPOTrainer,
        build_model(),
        tokenizer,
        prompt_dataset,
        tmp_path,
        max_steps=1,
        rollout_from_prompt_state=True,
    )
    monkeypatch.setattr(trainer.model, "generate", replaced_generate([]), raising=False)
    with pytest.raises(UnsupportedRolloutError, match="generate is not transformers' own"):
        trainer.train()
