"""Turning one dataloader item into the batch a rollouter generates from."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final, Literal

from ._batch import RolloutBatch, to_object_array
from ._config import config_bool, config_positive_int

__all__ = [
    "MULTI_TURN_AGENT",
    "NO_AGENT_NAME",
    "SINGLE_TURN_AGENT",
    "VERL_091_SINGLE_TURN_AGENT",
    "prepare_single_generation_data",
]

logger = logging.getLogger(__name__)

MULTI_TURN_AGENT = "async_partial_tool_agent"
"""Agent name set when ``actor_rollout_ref.rollout.multi_turn.enable`` is true."""

SINGLE_TURN_AGENT = "partial_single_turn_agent"
"""Agent name set otherwise."""

VERL_091_SINGLE_TURN_AGENT = "single_turn_agent"
"""What verl 0.9.1 sets when multi-turn is off: its registered agent loops are
``single_turn_agent`` and ``tool_agent`` (the defaults above are the later fully-async
version's, which the seed follows). Pass it as ``agent_name=`` to get 0.9.1's behaviour."""

NO_AGENT_NAME: Final = False
"""``agent_name=NO_AGENT_NAME`` leaves ``agent_name`` unset, as verl 0.9.1 does when
multi-turn is on (its agent loop then chooses by the dataset's own column, if any)."""

_MULTI_TURN_PATH = "actor_rollout_ref.rollout.multi_turn.enable"
_N_PATH = "actor_rollout_ref.rollout.n"


def prepare_single_generation_data(
    batch_dict: Mapping[str, Any] | Any,
    config: Any,
    *,
    agent_name: str | Literal[False] | None = None,
    batch_cls: Any = RolloutBatch,
) -> Any:
    """Build the generation input for one prompt: tag every row and repeat it ``n`` times.

    Every row gets ``non_tensor_batch["agent_name"]`` (an object array), then the batch is
    repeated ``actor_rollout_ref.rollout.n`` times, interleaved (``[a, a, b, b]``), so the
    ``n`` trajectories of one prompt are adjacent.

    Args:
        batch_dict: The collated dataloader dict (tensors and numpy arrays), or an already
            built batch object (``RolloutBatch`` or verl ``DataProto``), whose ``agent_name``
            column is then set in place before it is repeated.
        config: Trainer config (OmegaConf, dataclass, namespace or nested dicts). Reads
            ``actor_rollout_ref.rollout.n`` (required) and
            ``actor_rollout_ref.rollout.multi_turn.enable`` (false when missing).
        agent_name: Overrides the agent name chosen from the config:
            ``"async_partial_tool_agent"`` for multi-turn, ``"partial_single_turn_agent"``
            otherwise. An ``agent_name`` already in the data is overwritten either way.
            :data:`NO_AGENT_NAME` sets none (what verl 0.9.1 does for multi-turn; for its
            single-turn choice pass :data:`VERL_091_SINGLE_TURN_AGENT`).
        batch_cls: Class whose ``from_single_dict`` builds the batch from a dict; pass
            verl's ``DataProto`` to get one back.

    Returns:
        A new batch of ``len(input) * n`` rows, of ``batch_cls`` (or of the input's class).

    Raises:
        ConfigurationError: ``rollout.n`` is missing or not a positive integer.
        BatchTypeError: ``batch_dict`` holds a value that is neither a tensor nor an array.
    """
    n = config_positive_int(config, _N_PATH)
    if agent_name is None:
        multi_turn = config_bool(config, _MULTI_TURN_PATH, default=False)
        agent_name = MULTI_TURN_AGENT if multi_turn else SINGLE_TURN_AGENT
    full_batch: Any
    if hasattr(batch_dict, "non_tensor_batch"):
        full_batch = batch_dict
    else:
        full_batch = batch_cls.from_single_dict(batch_dict)
    if agent_name is not False:
        names = to_object_array([agent_name] * len(full_batch))
        full_batch.non_tensor_batch["agent_name"] = names
    logger.debug(
        "prepared %d row(s) for agent %r, repeating %d times", len(full_batch), agent_name, n
    )
    return full_batch.repeat(repeat_times=n, interleave=True)
