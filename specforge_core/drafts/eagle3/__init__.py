"""The EAGLE3 draft family: model, config, teacher, TTT attention, unrolled loss, metrics, files, decoding."""

from specforge_core.drafts.eagle3.metric_sums import add_metric_sums, all_reduce_metric_sums, summarize_metrics
from specforge_core.drafts.eagle3.objective import eagle3_loss, ttt_unroll

__all__ = ["eagle3_loss", "ttt_unroll", "summarize_metrics", "all_reduce_metric_sums", "add_metric_sums"]
