"""Rollouts: sampling, generation (plain and EAGLE-3 speculative, lossless), rollout engine."""
from .acceptance import Verdict, verify_coupled, verify_greedy, verify_sampling
from .engine import RefitError, RolloutEngine
from .config import GenerateConfig
from .generate import DecodeRunner, GenerateOutput, generate
from .sampling import SamplingParams, processed_logprobs, processed_probs, sample, sample_from_probs

__all__ = ["Verdict", "verify_coupled", "verify_greedy", "verify_sampling", "RefitError", "RolloutEngine",
           "DecodeRunner", "GenerateConfig", "GenerateOutput", "generate", "SamplingParams",
           "processed_logprobs", "processed_probs", "sample", "sample_from_probs"]
