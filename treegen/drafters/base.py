"""The Drafter protocol lives in the engine (treegen.engine.drafter); drafters import it from here too."""
from ..engine.drafter import Drafter, DraftState

__all__ = ["DraftState", "Drafter"]
