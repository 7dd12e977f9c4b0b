"""Old import path of workers/pipefusion/stages.py, kept for the two callers outside the
worker package's own moves (the host's memory plan, `worker_module("pipefusion_stages")`,
and workers/models/base.py's stage loader); new code imports workers.pipefusion.stages."""
from .pipefusion.stages import (SPLITS, WEIGHT_SLACK, RemoteBlock, StageInfo, block_cost,
                                finish_stage, keep_stage_blocks, load_stage_transformer,
                                model_blocks, parse_split, partition, plan_stages,
                                stage_block_names, stage_of_rank)

__all__ = ["SPLITS", "WEIGHT_SLACK", "RemoteBlock", "StageInfo", "block_cost", "finish_stage",
           "keep_stage_blocks", "load_stage_transformer", "model_blocks", "parse_split",
           "partition", "plan_stages", "stage_block_names", "stage_of_rank"]
