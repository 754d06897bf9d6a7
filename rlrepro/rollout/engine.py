"""The embedded deterministic engine: ``Engine(model_or_path, ...).generate(prompts, params)``.

Synchronous and single-process: ``generate`` admits every request, steps scheduler -> runner -> scheduler until
all finish, and returns one :class:`RequestOutput` per prompt, in input order. In ``deterministic=True`` mode
every step runs inside ``kernels.mode("deterministic")`` (batch-invariant kernels), which is what makes a
request's tokens and logprobs independent of batching, chunking, prefix caching and preemption; see
docs/ENGINE.md for the argument.
"""
from __future__ import annotations

import contextlib
import operator
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence as Seq
from typing import TYPE_CHECKING

import torch
from torch.profiler import record_function

from rlrepro import kernels
from rlrepro.checks import plain_number

from .block_manager import BlockManager
from .params import RequestOutput, SamplingParams
from .runner import ModelRunner, kv_block_bytes
from .scheduler import Scheduler
from .seeds import derive_seed
from .sequence import Sequence

if TYPE_CHECKING:
    from .config import EngineConfig

CPU_DEFAULT_KV_BYTES = 512 * 2**20  # default KV-cache cap on CPU when neither size argument is given
CUDA_RESERVE_FRACTION = 0.10  # of total GPU memory kept free for activations, logits, noise and graphs
CUDA_RESERVE_BYTES = 4 * 2**30


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _is_bool(token: object) -> bool:
    """A bool, numpy bool or bool tensor: ``operator.index(torch.tensor(True))`` is 1, but it is no token id."""
    dtype = getattr(token, "dtype", None)
    return isinstance(token, bool) or dtype is torch.bool or str(dtype) == "bool"


def _is_index(token: object) -> bool:
    """An integer token id (ints, numpy integers, 0-d integer tensors), not a bool. A one-element 1-D tensor is a
    one-token prompt, not a token id, though ``operator.index(torch.tensor([5]))`` is 5."""
    if _is_bool(token) or getattr(token, "ndim", 0) != 0:
        return False
    try:
        operator.index(token)
    except TypeError:
        return False
    return True


def _token_id(request: int, token: object, vocab: int) -> int:
    try:
        if _is_bool(token) or getattr(token, "ndim", 0) != 0:  # tensor([5]) is a list of one id, not an id
            raise TypeError
        value = operator.index(token)  # ints, numpy integers, 0-d integer tensors
    except TypeError:
        value = None
    if value is None or not 0 <= value < vocab:
        raise ValueError(f"request {request}: token id {token!r} is not an integer in [0, {vocab}) (the model's "
                         "vocabulary); check that the tokenizer matches the model")
    return value


def _mapping(what: str, obj: Mapping, example: str) -> str:
    """The error for a dict given where token ids belong (a tokenizer's ``BatchEncoding``, vLLM's
    ``{"prompt_token_ids": ...}``): iterating it would give its keys, so name them and the field to pass."""
    field = next((k for k in ("input_ids", "prompt_token_ids") if k in obj), "input_ids")
    return (f"{what}, got a {type(obj).__name__} with keys {list(obj)[:4]!r} (a tokenizer's output?); pass its "
            f"token ids, e.g. {example}[{field!r}]")


def _one_prompt(prompt: object) -> object:
    """``add_request``'s prompt, refused with the fix when it is a batch (a list of lists, a 2-D tensor or array);
    an iterator comes back as a list (it is read once)."""
    if _is_index(prompt):  # one token id (an int, a numpy integer, a 0-d tensor): not generate()'s flat-list error
        raise ValueError(f"add_request takes one prompt, a flat list of token ids, but got the single token id "
                         f"{prompt!r}; pass a list, e.g. add_request([{operator.index(prompt)}], params)")
    ndim, kind = getattr(prompt, "ndim", None), type(prompt).__name__
    if ndim is None and isinstance(prompt, Iterable) and not isinstance(prompt, (str, bytes, Mapping)):
        prompt = list(prompt)
        nested = [t for t in prompt
                  if isinstance(t, Iterable) and not isinstance(t, (str, bytes)) and getattr(t, "ndim", None) != 0]
    else:
        nested = [prompt] if ndim is not None and ndim >= 2 else []
    if nested:
        got = f"a {ndim}-D {kind}" if ndim is not None else f"a {kind} holding {type(nested[0]).__name__}s"
        raise ValueError(f"add_request takes one prompt, a flat list of token ids, but got {got} (a batch of "
                         "prompts?); queue several prompts with one add_request call each, or run them all at once "
                         "with generate([prompt, ...])")
    return prompt


_FIXES = {  # what each limit means, and the fix, for the error that refuses a bad value
    "max_num_seqs": "the most requests in one step (rollout.max_num_seqs), e.g. 256",
    "max_num_batched_tokens": "the most tokens in one step (rollout.max_num_batched_tokens), e.g. 8192; any value "
                              ">= 1 gives the same tokens, only speed changes",
    "block_size": "tokens per KV block (rollout.block_size), e.g. 16",
    "num_kv_blocks": "KV blocks in the cache (rollout.num_kv_blocks), or None to size it from memory",
    "kv_cache_memory_bytes": "an int, e.g. int(2e9) or 2 * 2**30, or None for the default size",
    "max_model_len": "or None for the model's max_position_embeddings (rollout.max_model_len)"}


def _positive_int(name: str, value: object) -> int:
    value = plain_number(value)  # a numpy integer is the int it holds, as for SamplingParams
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        fix = _FIXES.get(name, "1 or more")
        raise ValueError(f"Engine {name} must be a positive integer, got {value!r}; pass {fix}")
    return value


def _weight_pair(item: object) -> tuple[str, torch.Tensor]:
    """One ``(name, tensor)`` of ``load_weights``, or a ValueError that names what came instead."""
    pair = isinstance(item, (tuple, list)) and len(item) == 2
    if pair and isinstance(item[0], str) and isinstance(item[1], torch.Tensor):
        return item[0], item[1]
    what = f"the {type(item[1]).__name__} of {item[0]!r}" if pair else f"{type(item).__name__} {str(item)[:60]!r}"
    raise ValueError(f"load_weights takes (name, tensor) pairs (e.g. model.named_parameters() or "
                     f"state_dict.items()) or a dict of name -> tensor; got {what}")


def weight_problem(specs: Iterable[tuple[str, tuple, str]], params: Mapping[str, torch.Tensor], *,
                   complete: bool = False, sender: str = "the update") -> str | None:
    """What is wrong with an update of tensors ``specs`` = ``(name, shape, dtype name)`` for the parameters
    ``params``, or None: a name given twice, a name that is no parameter, a shape or dtype other than the
    parameter's, and with ``complete`` a parameter that does not come. Shared by :meth:`Engine.load_weights` and the
    weight sync's checks (a collective's header, a rollout worker's update), so that each path refuses alike."""
    specs = list(specs)
    names, seen = [n for n, _, _ in specs], set()
    twice = sorted({n for n in names if n in seen or seen.add(n)})
    if twice:
        return f"{sender} gives {twice[:4]} more than once"
    unknown = [n for n in names if n not in params]
    if unknown:
        more = f" (nor {unknown[1:4]})" if len(unknown) > 1 else ""
        return (f"the model has no parameter {unknown[0]!r}{more} that {sender} gives; expected names like "
                f"{next(iter(params))!r} (transformers' Qwen3 naming): are both the same model?")
    missing = sorted(set(params) - seen) if complete else []
    if missing:
        return f"{sender} lacks parameters of the model ({missing[:4]}); every parameter must come"
    for name, shape, dtype in specs:
        target = params[name]
        if tuple(shape) != tuple(target.shape) or dtype != str(target.dtype):
            return (f"{name!r} has shape {tuple(shape)} and dtype {dtype} in {sender}, expected shape "
                    f"{tuple(target.shape)} and dtype {target.dtype} (the model's parameter; a cast would not run "
                    "the sender's bits)")
    return None


def _without_tied_head(pairs: list[tuple[str, torch.Tensor]], params: Mapping[str, torch.Tensor]):
    """A tied model's update without its ``lm_head.weight``, which must equal the embedding the model holds after
    the update (the one sent, else the current one): ``(pairs, None)`` or ``(pairs, problem)``."""
    heads = [t for n, t in pairs if n == "lm_head.weight"]
    if not heads:
        return pairs, None
    if len(heads) > 1:
        return pairs, "the update gives ['lm_head.weight'] more than once"
    embed = [t for n, t in pairs if n == "model.embed_tokens.weight"]
    embed = embed[-1] if embed else params.get("model.embed_tokens.weight")
    head = heads[0]
    same = embed is not None and (_same_storage(head, embed) or same_bits(head, embed.detach().to(head.device)))
    if not same:
        return pairs, ("'lm_head.weight' differs from 'model.embed_tokens.weight', but this model ties its head to "
                       "the embedding (tie_word_embeddings): the sender's model is untied, not this one")
    return [(n, t) for n, t in pairs if n != "lm_head.weight"], None


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of the same memory (a tied model's head *is* its embedding)."""
    return (a.device == b.device and a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
            and a.shape == b.shape and a.dtype == b.dtype)


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bit-for-bit equality of two tensors (NaN equals its own bits, 0.0 is not -0.0), dtype and shape included;
    also ``repro.bisect``'s comparison of weights and activations."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    return torch.equal(x.detach().contiguous().reshape(-1).view(torch.uint8),
                       y.detach().contiguous().reshape(-1).view(torch.uint8))


def _flag(name: str, value: object, optional: bool = False) -> bool | None:
    """A boolean argument: True or False (or None for a default), never a truthy string such as "false"."""
    if (value is None and optional) or isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and getattr(value, "dtype", None) == bool and value.shape == ():
        return bool(value)  # numpy's bool scalar
    raise ValueError(f"Engine {name} must be True or False{' (or None for the default)' if optional else ''}, "
                     f"got {value!r}")


class Engine:
    """Deterministic paged-KV engine with continuous batching, chunked prefill, a prefix cache and preemption.

    ``model_or_path``: a ``Qwen3ForCausalLM`` (used as is, on its own device and dtype) or an HF model directory
    (loaded with ``load_pretrained(path, device, dtype)``). KV-cache size: ``num_kv_blocks`` blocks, or as many
    as fit in ``kv_cache_memory_bytes``; by default on CUDA what is free after loading minus a reserve, on CPU
    enough for ``max_num_seqs`` full-length sequences up to 512 MiB. ``max_model_len`` defaults to the model's
    ``max_position_embeddings`` and may not exceed it. ``enable_cuda_graphs`` (default: on for CUDA) captures
    decode steps.
    ``fuse_projections`` (default: on for CUDA) stores each layer's q/k/v and gate/up weights as one tensor each
    (``Qwen3ForCausalLM.fuse_projections``: same parameters and values, bitwise the same results on CUDA).
    """

    def __init__(self, model_or_path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 deterministic: bool = True, seed: int = 0, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, enable_prefix_cache: bool = True, block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory_bytes: int | None = None,
                 max_model_len: int | None = None, enable_cuda_graphs: bool | None = None,
                 fuse_projections: bool | None = None) -> None:
        # every argument that needs no model is checked first, before a checkpoint is loaded
        self.deterministic = _flag("deterministic", deterministic)
        seed = plain_number(seed)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"Engine seed must be an integer, got {seed!r}")
        self.max_num_seqs = _positive_int("max_num_seqs", max_num_seqs)
        self.max_num_batched_tokens = _positive_int("max_num_batched_tokens", max_num_batched_tokens)
        self.block_size = _positive_int("block_size", block_size)
        if max_model_len is not None and _positive_int("max_model_len", max_model_len) < 2:
            raise ValueError(f"max_model_len must be >= 2 (a prompt token and a generated one), got {max_model_len}; "
                             f"pass {_FIXES['max_model_len']}")
        for name, value in (("num_kv_blocks", num_kv_blocks), ("kv_cache_memory_bytes", kv_cache_memory_bytes)):
            if value is not None:
                _positive_int(name, value)
        if num_kv_blocks is not None and kv_cache_memory_bytes is not None:
            raise ValueError(f"Engine: num_kv_blocks={num_kv_blocks!r} and kv_cache_memory_bytes="
                             f"{kv_cache_memory_bytes!r} both size the KV cache: pass one of them")
        enable_prefix_cache = _flag("enable_prefix_cache", enable_prefix_cache)
        enable_cuda_graphs = _flag("enable_cuda_graphs", enable_cuda_graphs, optional=True)
        fuse_projections = _flag("fuse_projections", fuse_projections, optional=True)
        if isinstance(model_or_path, (str, os.PathLike)):
            from rlrepro.model import load_pretrained

            model = load_pretrained(model_or_path, device=device, dtype=dtype)
        else:
            model = model_or_path
            if not hasattr(model, "forward_tokens") or not hasattr(model, "config"):
                raise ValueError(f"Engine needs a Qwen3ForCausalLM or a model directory path, got "
                                 f"{type(model).__name__}")
            if not _same_device(torch.device(device), model.device):
                raise ValueError(f"the model is on {model.device} but device={str(device)!r}; pass "
                                 f"device={str(model.device)!r} or move the model first")
            if dtype is not None and dtype != model.dtype:
                raise ValueError(f"the model is {model.dtype} but dtype={dtype}; pass dtype=None or convert "
                                 "the model first (an Engine uses a model object as is)")
        self.model = model
        self.config = model.config
        self.device = model.device
        self.seed = seed
        self.max_model_len = _positive_int(
            "max_model_len", self.config.max_position_embeddings if max_model_len is None else max_model_len)
        limit = self.config.max_position_embeddings
        if self.max_model_len > limit:  # vLLM and SGLang refuse this too (they have an opt-in override; rlrepro none)
            raise ValueError(f"Engine max_model_len={self.max_model_len} exceeds the model config's "
                             f"max_position_embeddings={limit}: the model was not built for positions past {limit} "
                             "and rlrepro has no RoPE scaling to stretch it; lower max_model_len "
                             f"(rollout.max_model_len) to at most {limit}, or leave it None for the model's own "
                             "length")
        self.vocab_size = self.config.vocab_size
        eos = self.config.eos_token_id
        eos = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
        # config.json's and generation_config.json's (Qwen3: <|im_end|> and <|endoftext|>), as vLLM stops on both
        eos += getattr(self.config, "generation_eos_token_ids", ())
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        self.num_kv_blocks = self._num_blocks(num_kv_blocks, kv_cache_memory_bytes)
        self.enable_prefix_cache = enable_prefix_cache
        self.block_manager = BlockManager(self.num_kv_blocks, self.block_size, self.enable_prefix_cache)
        self.scheduler = Scheduler(self.block_manager, self.max_num_seqs, self.max_num_batched_tokens,
                                   self.max_model_len, self.eos_token_ids)
        if enable_cuda_graphs is None:
            enable_cuda_graphs = self.device.type == "cuda"
        if fuse_projections is None:
            fuse_projections = self.device.type == "cuda"
        if fuse_projections and hasattr(model, "fuse_projections"):
            model.fuse_projections()
        with self._mode():
            self.runner = ModelRunner(model, num_blocks=self.num_kv_blocks, block_size=self.block_size,
                                      max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                                      enable_cuda_graphs=bool(enable_cuda_graphs))
        self.weight_version = 0
        self.num_requests = 0  # requests accepted so far: the index that derives an unseeded request's seed
        self._pending = None  # (rows, StepOutput) of the step in flight
        self._added: dict[int, Sequence] = {}  # requests from add_request() not yet returned by step()
        self._aborted: list[Sequence] = []  # finished by abort() between steps, returned by the next step()

    @classmethod
    def from_config(cls, model_or_path, config: "EngineConfig", *, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None, deterministic: bool = True, seed: int = 0,
                    **kwargs) -> "Engine":
        """An engine with the settings of ``config`` (:class:`rlrepro.rollout.EngineConfig`, the ``rollout.*`` keys).
        On CUDA without ``num_kv_blocks`` the KV cache takes ``gpu_memory_fraction`` of the GPU's memory."""
        engine_kwargs = config.engine_kwargs()
        fraction = engine_kwargs.pop("gpu_memory_fraction")
        on_cuda = torch.device(device).type == "cuda"
        if on_cuda and engine_kwargs.get("num_kv_blocks") is None and fraction:
            index = torch.device(device).index or 0
            total = torch.cuda.get_device_properties(index).total_memory
            engine_kwargs["kv_cache_memory_bytes"] = int(fraction * total)
        return cls(model_or_path, device=device, dtype=dtype, deterministic=deterministic, seed=seed,
                   **engine_kwargs, **kwargs)

    def _num_blocks(self, num_kv_blocks: int | None, kv_cache_memory_bytes: int | None) -> int:
        if num_kv_blocks is not None:
            return _positive_int("num_kv_blocks", num_kv_blocks)
        per_block = kv_block_bytes(self.config, self.block_size, self.model.dtype)
        max_useful = self.max_num_seqs * -(-self.max_model_len // self.block_size)
        if kv_cache_memory_bytes is not None:
            budget = _positive_int("kv_cache_memory_bytes", kv_cache_memory_bytes)
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - max(int(CUDA_RESERVE_FRACTION * total), CUDA_RESERVE_BYTES)
        else:
            budget = min(max_useful * per_block, CPU_DEFAULT_KV_BYTES)
        blocks = min(budget // per_block, max_useful) if kv_cache_memory_bytes is None else budget // per_block
        if blocks < 1:
            raise ValueError(f"the KV-cache budget ({budget} bytes) holds no block of {per_block} bytes; "
                             "raise kv_cache_memory_bytes or pass num_kv_blocks")
        return int(blocks)

    @contextlib.contextmanager
    def _mode(self) -> Iterator[None]:
        """The kernel mode and, on CUDA, the engine's card as the current device: Triton launches, CUDA-graph
        capture (its side stream) and the step's read-back event use the current device, which for
        ``device="cuda:1"`` need not be the model's."""
        on_card = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with on_card, kernels.mode("deterministic" if self.deterministic else "fast"):
            yield

    # ---- generation ---------------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: Seq[Seq[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate a completion for each prompt (lists of token ids); outputs come back in input order.

        Every request is validated before any work; a ValueError names the request index and the fix, and
        leaves the engine as it was."""
        if self._added:
            raise RuntimeError(f"generate() while {len(self._added)} request(s) from add_request() are unfinished; "
                               "call step() until has_unfinished() is False first")
        prompts, params = self._validate(prompt_token_ids, sampling_params)
        seqs = [self._new_sequence(prompt, p) for prompt, p in zip(prompts, params)]
        for seq in seqs:
            self.scheduler.add(seq)
        try:
            with self._mode():
                while self.has_unfinished():
                    self._step()
        except BaseException:  # an error or interrupt mid-run: free everything, keep the engine usable
            self._abort_all()
            raise
        return [self._output(s) for s in seqs]

    # ---- incremental use: requests added while others run ---------------------------------------------------
    def add_request(self, prompt_token_ids: Seq[int], sampling_params: SamplingParams | None = None) -> int:
        """Queue one request (validated as by :meth:`generate`) and return its id; :meth:`step` runs it along with
        whatever else is in flight. Its output is the one :meth:`generate` would give: a request's tokens do not
        depend on the batch or the step it joins (the seed of an unseeded request follows the order requests are
        accepted in, as for ``generate``)."""
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"add_request takes one SamplingParams, got {type(sampling_params).__name__}")
        prompt_token_ids = _one_prompt(prompt_token_ids)
        (prompt,), (params,) = self._validate([prompt_token_ids], [sampling_params or SamplingParams()],
                                              first_index=self.num_requests)  # errors name the id it would get
        seq = self._new_sequence(prompt, params)
        self.scheduler.add(seq)
        self._added[seq.seq_id] = seq
        return seq.seq_id

    def step(self) -> list[RequestOutput]:
        """Run one engine step (schedule and launch the next batch, read back the previous one's tokens); return
        the requests from :meth:`add_request` that finished, in id order. An error aborts every unfinished
        request (they are not returned) and leaves the engine usable."""
        try:
            with self._mode():
                finished = self._step()
        except BaseException:
            self._abort_all()
            raise
        finished += self._aborted
        self._aborted = []
        done = [self._added.pop(s.seq_id) for s in sorted(finished, key=lambda s: s.seq_id) if s.seq_id in self._added]
        return [self._output(s) for s in done]

    def abort(self, request_id: int) -> None:
        """Stop a request from :meth:`add_request`: it is scheduled no more and the next :meth:`step` returns it
        with ``finish_reason="abort"`` and the tokens it had (plus one still in flight, if any). The other
        requests' outputs do not change (nothing a request gets depends on its batch)."""
        # (a bool or a float is no id: True == 1 would abort request 1, 0.0 == 0 request 0)
        seq = self._added.get(operator.index(request_id)) if _is_index(request_id) else None
        if seq is None:
            raise ValueError(f"abort: {request_id!r} is not an unfinished request from add_request() (ids are the "
                             "integers add_request() returned; finished requests were returned by step())")
        if seq.abort_requested or seq.is_finished:
            return  # aborted already, or finished: step() returns it
        if self.scheduler.abort(seq):
            self._aborted.append(seq)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, running, has a step in flight, or was aborted and not yet returned."""
        return self.scheduler.has_unfinished() or self._pending is not None or bool(self._aborted)

    def _new_sequence(self, prompt: list[int], params: SamplingParams) -> Sequence:
        index = self.num_requests
        self.num_requests += 1
        seed = params.seed if params.seed is not None else derive_seed(self.seed, index)
        return Sequence(index, prompt, params, seed)

    def _output(self, s: Sequence) -> RequestOutput:
        return RequestOutput(prompt_token_ids=s.prompt_token_ids, token_ids=s.output_token_ids,
                             logprobs=list(s.output_logprobs), finish_reason=s.finish_reason, seed=s.seed,
                             weight_version=self.weight_version, request_id=s.seq_id,
                             num_cached_tokens=s.num_cached_tokens)

    def _abort_all(self) -> None:
        """After an exception (or interrupt) mid-step: drop the step in flight and free every request."""
        self._pending = None
        self._added.clear()
        self._aborted = []
        if self.scheduler.has_unfinished():
            self.scheduler.abort_all()

    def _step(self) -> list[Sequence]:
        """One iteration of the loop, one step ahead of the host: step t+1 is scheduled and launched before step
        t's sampled tokens are read back, so on CUDA the host's work overlaps the device's. Tokens the host has
        not seen yet are placeholders that the runner feeds from the device (``Scheduler.launched`` /
        ``resolve``); a request that samples a stop token is noticed one step late and its extra row discarded.
        Which step a token is computed in never changes it (see docs/ENGINE.md), so this is invisible in the
        outputs. Returns the sequences that finished."""
        sch = self.scheduler
        with record_function("rlrepro.schedule"):
            scheduled = sch.schedule()
        with record_function("rlrepro.launch"):
            step = self.runner.launch(scheduled) if scheduled else None
        finished: list[Sequence] = []
        if self._pending is not None:
            with record_function("rlrepro.resolve"):
                finished = sch.resolve(self._pending[0], self._pending[1].result())
        self._pending = (sch.launched(scheduled), step) if step is not None else None
        return finished

    def _validate(self, prompt_token_ids, sampling_params,
                  first_index: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
        if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Iterable):
            raise ValueError("generate() takes a list of prompts, each a list of token ids; got "
                             f"{type(prompt_token_ids).__name__}")
        if isinstance(prompt_token_ids, Mapping):  # iterating it would give its keys
            raise ValueError(_mapping("generate() takes a list of prompts, each a list of token ids",
                                      prompt_token_ids, "generate(encoding") + ")")
        if getattr(prompt_token_ids, "ndim", None) == 1:  # a 1-D tensor or array is one prompt, not many
            raise ValueError("generate() takes a list of prompts, each a list of token ids; got one 1-D "
                             f"{type(prompt_token_ids).__name__}: wrap it as [prompt]")
        prompts = [p for p in prompt_token_ids]
        if prompts and all(_is_index(t) for t in prompts):
            raise ValueError("generate() takes a list of prompts, each a list of token ids; got one flat list of "
                             "ints: wrap it as [prompt]")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif (isinstance(sampling_params, (str, bytes, Mapping)) or not isinstance(sampling_params, Iterable)
              or hasattr(sampling_params, "ndim")):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), got "
                             f"{type(sampling_params).__name__} {sampling_params!r}; build one with "
                             "SamplingParams(temperature=..., max_tokens=...) or SamplingConfig(...).params(seed=...)")
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one "
                                 "SamplingParams for all, or one per prompt")
            for i, p in enumerate(params):
                if not isinstance(p, SamplingParams):
                    raise ValueError(f"request {i}: sampling params must be a SamplingParams, got "
                                     f"{type(p).__name__}")
        vocab, bs = self.vocab_size, self.block_size
        out = []
        for i, (prompt, p) in enumerate(zip(prompts, params), start=first_index):
            if isinstance(prompt, Mapping):
                raise ValueError(_mapping(f"request {i}: a prompt must be a list of token ids", prompt, "prompt"))
            if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Iterable):
                raise ValueError(f"request {i}: a prompt must be a list of token ids, got {type(prompt).__name__}; "
                                 "tokenize text first")
            if isinstance(prompt, torch.Tensor):
                prompt = prompt.tolist()
            prompt = [_token_id(i, t, vocab) for t in prompt]
            if not prompt:
                raise ValueError(f"request {i}: the prompt is empty; give at least one token (e.g. BOS)")
            stop_bad = [t for t in p.stop_token_ids if t >= vocab]
            if stop_bad:
                raise ValueError(f"request {i}: stop_token_ids {stop_bad} lie outside the vocabulary [0, {vocab}) "
                                 "and could never be sampled; remove them, or check that the tokenizer matches the "
                                 "model")
            n = len(prompt)
            if n >= self.max_model_len:
                raise ValueError(f"request {i}: the prompt has {n} tokens but the context holds max_model_len="
                                 f"{self.max_model_len} (the prompt plus at least one generated token); shorten "
                                 "the prompt or raise max_model_len")
            if n + p.max_tokens > self.max_model_len:
                raise ValueError(f"request {i}: prompt ({n} tokens) + max_tokens ({p.max_tokens}) = "
                                 f"{n + p.max_tokens} exceeds max_model_len={self.max_model_len}; lower max_tokens "
                                 f"to at most {self.max_model_len - n} or raise max_model_len")
            # Positions 0 .. n + max_tokens - 2 get K/V (the last sampled token is never fed back).
            need = -(-(n + p.max_tokens - 1) // bs)
            if need > self.num_kv_blocks:
                raise ValueError(f"request {i}: prompt + max_tokens needs {need} KV blocks of {bs} tokens but the "
                                 f"cache has {self.num_kv_blocks}; raise num_kv_blocks / kv_cache_memory_bytes or "
                                 "lower max_tokens")
            out.append(prompt)
        return out, params

    # ---- weights and cache --------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy new weights into the model in place (CUDA graphs stay valid) and drop the prefix cache.

        ``named_tensors``: ``(name, tensor)`` pairs or a dict of them (a state dict), all of the parameters or some.
        Names follow ``model.named_parameters()`` (transformers' names); with tied embeddings ``lm_head.weight`` may
        come when it equals the embedding (the head *is* the embedding here). All or nothing: every tensor is
        checked first (:meth:`check_weights`: names, duplicates, shapes and dtypes equal to the parameters'; no
        cast, which would run other bits than the sender's) and a ValueError naming the first offending tensor and
        what was expected leaves every weight and the version as they were.
        """
        version = plain_number(version)  # a numpy integer is the int it holds, as for the other arguments
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"load_weights version must be an integer, got {version!r}")
        if self.has_unfinished():
            raise RuntimeError("load_weights while requests are unfinished: their tokens so far (and their K/V) "
                               "come from the old weights, so their logprobs would match neither policy; call "
                               "step() until has_unfinished() is False first")
        params = dict(self.model.named_parameters())
        try:
            pairs = self.check_weights(named_tensors)
            for name, tensor in pairs:
                params[name].copy_(tensor.detach())
        finally:  # a copy that fails part way (a device error) leaves a mix: the cached K/V's weights may be gone
            self.reset_prefix_cache()
        self.weight_version = version

    def check_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                      complete: bool = False) -> list[tuple[str, torch.Tensor]]:
        """The ``(name, tensor)`` pairs of an update (pairs or a dict) that :meth:`load_weights` would copy, checked
        whole before anything is written: each a (name, tensor) pair of a parameter of the model, once, with its
        shape and dtype (:func:`weight_problem`); ``complete``: every parameter must come. A tied model's
        ``lm_head.weight`` is left out when it equals the embedding that the update leaves (else refused: the
        sender's head is not this model's). ValueError naming the offending tensor and what was expected."""
        params = dict(self.model.named_parameters())
        if isinstance(named_tensors, Mapping):  # a state dict: iterating it would give names only
            named_tensors = named_tensors.items()
        pairs = [_weight_pair(item) for item in named_tensors]
        if getattr(self.config, "tie_word_embeddings", False) and "lm_head.weight" not in params:
            pairs, problem = _without_tied_head(pairs, params)
            if problem is not None:
                raise ValueError(f"load_weights: {problem}")
        problem = weight_problem([(n, tuple(t.shape), str(t.dtype)) for n, t in pairs], params, complete=complete)
        if problem is not None:
            raise ValueError(f"load_weights: {problem}")
        return pairs

    def receive_weights(self, fill: Callable[[dict[str, torch.Tensor]], int]) -> int:
        """Let ``fill`` write new weights straight into the model's parameters (e.g. a collective broadcast
        received in place): ``fill(params)`` gets ``dict(model.named_parameters())``, writes them without
        autograd and returns the weight version it received. The same guard as :meth:`load_weights` (no request
        may be unfinished) applies, and the prefix cache is dropped afterwards. Returns the version."""
        if self.has_unfinished():
            raise RuntimeError("receive_weights while requests are unfinished: their tokens so far (and their K/V) "
                               "come from the old weights; call step() until has_unfinished() is False first")
        try:
            with torch.no_grad():
                version = fill(dict(self.model.named_parameters()))
        finally:  # even if fill fails part way: the weights the cached K/V came from may be gone
            self.reset_prefix_cache()
        version = plain_number(version)
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"receive_weights: the filler returned version {version!r}, not an integer")
        self.weight_version = version
        return version

    def reset_prefix_cache(self) -> None:
        """Forget all cached prefix blocks (their K/V were computed with the weights of the time)."""
        self.block_manager.reset_prefix_cache()

    @property
    def stats(self) -> dict[str, int]:
        return {"num_steps": self.scheduler.num_steps, "num_preemptions": self.scheduler.num_preemptions,
                "num_prefix_hit_blocks": self.block_manager.num_prefix_hits,
                "num_cached_blocks": self.block_manager.num_cached_blocks,
                "num_graph_steps": self.runner.num_graph_steps, "num_kv_blocks": self.num_kv_blocks}
