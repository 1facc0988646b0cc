"""The EAGLE-3 draft model (SGLang's LlamaForCausalLMEagle3 layout) and its export."""

from eagle3.drafter.config import DrafterConfig
from eagle3.drafter.export import export_drafter, load_drafter
from eagle3.drafter.model import DrafterCache, Eagle3Drafter
from eagle3.drafter.ttt_attention import TTTCache

__all__ = ["DrafterCache", "DrafterConfig", "Eagle3Drafter", "export_drafter", "load_drafter", "TTTCache"]
