"""The CPU rehearsal's trainer: the tiny Llama the engines serve, trained for real on gloo.

The model is ``transformers.LlamaForCausalLM`` built from the SAME ``config.json`` the vLLM
engines load, so its ``named_parameters()`` are exactly the HF names vLLM's ``load_weights``
expects and its weights can be cached and synced into the engines. Each step is a real AdamW
step on a REINFORCE-style loss over the generated samples (toy reward: share of generated
tokens in the lower half of the vocabulary), with the gradients all-reduced over Megatron's
data-parallel group on gloo. Megatron's process groups are destroyed after every step and
re-initialised before the next one (:class:`~rlix_plugins.training.nccl_lifecycle.
MegatronParallelLifecycle`), as the NeMo RL adapter does around a GPU step.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Parameters vLLM keeps under the same name and layout as HF (not fused, not repacked by the
#: CPU GEMM kernels): their bytes can be compared between trainer and engine.
PLAIN_PARAM_SUFFIXES = ("embed_tokens.weight", "lm_head.weight", "norm.weight",
                        "layernorm.weight")


@dataclass(frozen=True, slots=True)
class TrainStepStats:
    """One optimizer step."""

    step: int
    loss: float
    mean_reward: float
    samples: int
    groups_destroyed: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def plain_param(name: str) -> bool:
    """True for a parameter whose bytes vLLM holds unchanged (see PLAIN_PARAM_SUFFIXES)."""
    return name.endswith(PLAIN_PARAM_SUFFIXES)


class TinyLlamaTrainer:
    """A one-rank gloo "training cluster" for the tiny Llama (see module docstring).

    Args:
        model_dir: directory holding the tiny Llama ``config.json`` (the engines' model).
        seed: initial weights' seed.
        lr: AdamW learning rate (large enough that every step changes the bf16 weights).
    """

    def __init__(self, model_dir: Path, *, seed: int, lr: float = 1e-3) -> None:
        import torch
        import torch.distributed as dist
        from transformers import LlamaConfig, LlamaForCausalLM

        from rlix_plugins.training.nccl_lifecycle import MegatronParallelLifecycle, ParallelConfig

        torch.manual_seed(seed)
        # One intra-op thread: the trainer stands in for one GPU, the engines own the cores.
        torch.set_num_threads(1)
        config = LlamaConfig.from_pretrained(str(model_dir))
        self.vocab_size = int(config.vocab_size)
        self.model = LlamaForCausalLM(config).float()  # type: ignore[no-untyped-call]
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        if not dist.is_initialized():
            # A private world per pipeline process; gloo is what this box has (no NCCL).
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
            )
        self.lifecycle = MegatronParallelLifecycle(
            ParallelConfig.of(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        )
        self.lifecycle.initialize()
        self.steps_done = 0
        self.cycles = 0
        #: told ``"nccl_reinit"`` / ``"nccl_destroy"`` once the groups are re-made / gone
        #: (the rehearsal records them as a host adapter does)
        self.on_nccl: Callable[[str], None] | None = None

    def ensure_groups(self) -> None:
        """Re-initialise Megatron's groups if the last step destroyed them (before a step)."""
        if not self.lifecycle.initialized:
            self.lifecycle.reinitialize()
            if self.on_nccl is not None:
                self.on_nccl("nccl_reinit")

    def train_step(
        self, samples: Sequence[tuple[Sequence[int], Sequence[int]]], step: int
    ) -> TrainStepStats:
        """One AdamW step on ``(prompt, completion)`` token samples; destroys the groups after."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state

        self.ensure_groups()
        half = self.vocab_size // 2
        rewards = [sum(1 for t in c if t < half) / max(1, len(c)) for _, c in samples]
        baseline = sum(rewards) / max(1, len(rewards))
        self.optimizer.zero_grad(set_to_none=True)
        # One padded batch: right-pad with token 0, score only completion tokens.
        seqs = [list(p) + list(c) for p, c in samples]
        width = max(len(x) for x in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        score = torch.zeros((len(seqs), width - 1))
        for i, ((prompt, completion), seq) in enumerate(zip(samples, seqs, strict=True)):
            ids[i, : len(seq)] = torch.tensor(seq)
            attn[i, : len(seq)] = 1
            # target position t predicts token t+1: completion tokens are targets
            # len(prompt)..len(seq)-1, i.e. logits rows len(prompt)-1..len(seq)-2
            score[i, len(prompt) - 1 : len(seq) - 1] = 1.0 / max(1, len(completion))
        logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1)
        token_lp = logp.gather(2, ids[:, 1:, None])[..., 0]
        # REINFORCE with a batch-mean baseline (+0.1 so a uniform reward still moves weights).
        adv = torch.tensor([r - baseline + 0.1 for r in rewards])
        loss = -(adv[:, None] * token_lp * score).sum() / max(1, len(samples))
        loss.backward()  # type: ignore[no-untyped-call]
        dp_group = parallel_state.get_data_parallel_group()
        for p in self.model.parameters():
            if p.grad is not None:
                # Real collective on the group re-created this step (world size 1 here; on a
                # GPU box this is NCCL over the data-parallel ranks).
                dist.all_reduce(p.grad, group=dp_group)
        self.optimizer.step()
        report = self.lifecycle.destroy()
        self.cycles += 1
        if self.on_nccl is not None:
            self.on_nccl("nccl_destroy")
        self.steps_done += 1
        return TrainStepStats(step, float(loss.detach()), baseline, len(samples),
                              report.destroyed)

    def hf_weights(self) -> Iterator[tuple[str, Any]]:
        """HF-named bf16 copies of every parameter (what the host's gather yields)."""
        import torch

        for name, p in self.model.named_parameters():
            yield name, p.detach().to(torch.bfloat16).contiguous()

    def plain_checksums(self) -> dict[str, str]:
        """Fletcher-64 of the bf16 bytes of the plain parameters (engine-comparable)."""
        from rlix_plugins.training.checksum import tensor_fingerprint

        return {name: tensor_fingerprint(t) for name, t in self.hf_weights()
                if plain_param(name)}

    def close(self) -> None:
        import torch.distributed as dist

        if self.lifecycle.initialized:
            self.lifecycle.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()
