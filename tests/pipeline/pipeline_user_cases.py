"""Rank-side cases for tests/pipeline/test_pipeline_user.py: what a training script sees under pipeline
parallelism (smp.state's pipeline coordinates). Each returns plain data."""

from __future__ import annotations

import smp


def state_coordinates(config: dict) -> dict:
    """smp.state's pipeline and data-parallel coordinates on this rank."""
    with smp.session(config):
        st = smp.state
        return {"rank": st.rank, "pp_rank": st.pp_rank, "pp_size": st.pp_size, "dp_rank": st.dp_rank,
                "dp_size": st.dp_size}


def evaluate_vs_one_process(config: dict, steps: int = 2) -> dict:
    """smp.pipeline.evaluate (forward only, right-padded rows) between training steps vs the whole
    model's masked loss in eval mode, in one process on the whole batch; and what evaluating
    leaves behind (gradients, the next training step's loss and gradients)."""
    import copy

    import torch

    import smp.pipeline
    from smp.testing.distributed import full_tensor, local_rows
    from smp.testing.models import random_batch
    from tests.pipeline.pipeline_cases import GLOBAL_BATCH, SEQ, VOCAB, reference_loss, tiny_model

    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        reference = tiny_model("llama")
        model = smp.transform(copy.deepcopy(reference))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        ref_params = dict(reference.named_parameters())
        batch, held_out = (random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=s) for s in (100, 7))
        # Held-out rows right-padded by different amounts (row r ends in r padding positions): the
        # loss counts only their tokens' targets, over the whole batch.
        mask = torch.ones(GLOBAL_BATCH, SEQ, dtype=torch.long)
        for row in range(1, GLOBAL_BATCH):
            mask[row, SEQ - row:] = 0
        report = {"eval_diff": 0.0, "loss_diff": 0.0, "grad_diff": 0.0, "grads_after_eval": 0, "eval_losses": []}
        for _ in range(steps):
            model.eval(), reference.eval()
            loss = smp.pipeline.evaluate(model, local_rows(held_out), attention_mask=local_rows(mask))
            with torch.no_grad():
                ref_eval = float(reference(input_ids=held_out, attention_mask=mask,
                                           labels=held_out.masked_fill(mask == 0, -100)).loss)
            report["eval_losses"].append(ref_eval)
            report["eval_diff"] = max(report["eval_diff"], abs(float(loss) - ref_eval))
            # The control: the same rows without their mask (padding counted as targets).
            unmasked = smp.pipeline.evaluate(model, local_rows(held_out))
            report["unmasked_diff"] = min(report.get("unmasked_diff", 1.0), abs(float(unmasked) - ref_eval))
            report["grads_after_eval"] += sum(p.grad is not None for p in model.parameters())
            model.train(), reference.train()
            loss = smp.pipeline.step(model, local_rows(batch))
            ref_loss = reference_loss(reference, batch)
            ref_loss.backward()
            report["loss_diff"] = max(report["loss_diff"], abs(float(loss) - float(ref_loss.detach())))
            for name, p in model.named_parameters():
                diff = float((full_tensor(p.grad) - ref_params[name].grad).abs().max())
                report["grad_diff"] = max(report["grad_diff"], diff)
            opt.step(), ref_opt.step()
            opt.zero_grad(set_to_none=True), ref_opt.zero_grad(set_to_none=True)
        return report
