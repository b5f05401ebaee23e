"""TransferQueue's samplers; under tqueue the built-in ones map onto controller policies."""

from transfer_queue.sampler.base import BaseSampler
from transfer_queue.sampler.grpo_group_n_sampler import GRPOGroupNSampler
from transfer_queue.sampler.rank_aware_sampler import RankAwareSampler
from transfer_queue.sampler.seqlen_balanced_sampler import SeqlenBalancedSampler
from transfer_queue.sampler.sequential_sampler import SequentialSampler

__all__ = ["BaseSampler", "GRPOGroupNSampler", "RankAwareSampler", "SeqlenBalancedSampler", "SequentialSampler"]
