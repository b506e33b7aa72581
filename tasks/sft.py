"""The supervised warm-start task."""

from __future__ import annotations

from flytekit import task

from containers.images import cpu_image
from miles_core.config import DataConfig, SFTConfig
from miles_core.data.source import load_prompts
from miles_core.models.tokenizers import load_tokenizer
from miles_core.train.backends import trainer_class
from miles_core.train.sft import demonstrations, run_sft, sft_train_config
from miles_core.weights.publish import publish
from tasks.common import Dataset, Policy, cache_version, new_artifact, uploaded_dir, uri_of
from tasks.metadata import MEDIUM, cached, declared
from tasks.retry import recoverable


@task(**cached(cache_version(SFTConfig, DataConfig, module=__name__)), container_image=cpu_image, **declared("sft", MEDIUM, minutes=240))
@recoverable
def sft(cfg: SFTConfig, data: DataConfig, base: Policy, dataset: Dataset, root: str) -> Policy:
    """SFT on the train split's demonstrations; the result is published as the next version."""
    base_dir = base.dir.download()
    tokenizer = load_tokenizer(base_dir)
    prompts = load_prompts(dataset.train.download(), data.input_key, data.label_key, data.metadata_key)
    train_cfg = sft_train_config(cfg)
    trainer = trainer_class(train_cfg).from_hf(base_dir, train_cfg)
    metrics = run_sft(trainer, demonstrations(prompts, tokenizer), cfg, tokenizer.pad_token_id)
    print(f"sft: {cfg.steps} steps, final loss {metrics.get('sft/loss', float('nan')):.4f}")
    out, dest = new_artifact(root, "sft", 0, cfg, uri_of(base.dir), dataset.sha256)
    publish(trainer, base_dir, out, "float32", version=base.version + 1, parent_version=base.version, source=uri_of(base.dir))
    return Policy(dir=uploaded_dir(out, dest), version=base.version + 1)
