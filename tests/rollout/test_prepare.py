from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import trajtrack
from trajtrack.rollout import (
    MULTI_TURN_AGENT,
    NO_AGENT_NAME,
    SINGLE_TURN_AGENT,
    VERL_091_SINGLE_TURN_AGENT,
    RolloutBatch,
    prepare_single_generation_data,
)

from ._fakes import FakeDataProto


def dict_config(n: Any = 3, multi_turn: bool | None = False) -> dict[str, Any]:
    rollout: dict[str, Any] = {"n": n}
    if multi_turn is not None:
        rollout["multi_turn"] = {"enable": multi_turn}
    return {"actor_rollout_ref": {"rollout": rollout}}


def batch_dict() -> dict[str, Any]:
    return {
        "input_ids": torch.tensor([[11, 12], [21, 22]]),
        "raw_prompt": np.array(["p1", "p2"], dtype=object),
    }


def test_single_turn_agent_and_interleaved_repeat() -> None:
    out = prepare_single_generation_data(batch_dict(), dict_config(n=3))
    assert isinstance(out, RolloutBatch)
    assert len(out) == 6
    assert out.batch["input_ids"][:, 0].tolist() == [11, 11, 11, 21, 21, 21]
    assert out.non_tensor_batch["raw_prompt"].tolist() == ["p1"] * 3 + ["p2"] * 3
    agents = out.non_tensor_batch["agent_name"]
    assert agents.dtype == object
    assert agents.tolist() == ["partial_single_turn_agent"] * 6
    assert SINGLE_TURN_AGENT == "partial_single_turn_agent"


def test_multi_turn_agent() -> None:
    out = prepare_single_generation_data(batch_dict(), dict_config(n=1, multi_turn=True))
    assert out.non_tensor_batch["agent_name"].tolist() == ["async_partial_tool_agent"] * 2
    assert MULTI_TURN_AGENT == "async_partial_tool_agent"


def test_missing_multi_turn_means_single_turn() -> None:
    out = prepare_single_generation_data(batch_dict(), dict_config(n=1, multi_turn=None))
    assert out.non_tensor_batch["agent_name"].tolist() == [SINGLE_TURN_AGENT] * 2


def test_agent_name_override_replaces_dataset_value() -> None:
    data = batch_dict()
    data["agent_name"] = np.array(["dataset_agent", "dataset_agent"], dtype=object)
    out = prepare_single_generation_data(
        data, dict_config(n=2, multi_turn=True), agent_name="my_agent"
    )
    assert out.non_tensor_batch["agent_name"].tolist() == ["my_agent"] * 4


@dataclasses.dataclass
class MultiTurn:
    enable: bool


@dataclasses.dataclass
class Rollout:
    n: int
    multi_turn: MultiTurn


@dataclasses.dataclass
class ActorRolloutRef:
    rollout: Rollout


@dataclasses.dataclass
class Config:
    actor_rollout_ref: ActorRolloutRef


@pytest.mark.parametrize(
    "config",
    [
        Config(ActorRolloutRef(Rollout(n=2, multi_turn=MultiTurn(enable=True)))),
        SimpleNamespace(
            actor_rollout_ref=SimpleNamespace(
                rollout=SimpleNamespace(n=2, multi_turn={"enable": True})
            )
        ),
        dict_config(n=2, multi_turn=True),
    ],
    ids=["dataclass", "namespace-with-dict", "dict"],
)
def test_config_kinds(config: object) -> None:
    out = prepare_single_generation_data(batch_dict(), config)
    assert len(out) == 4
    assert out.non_tensor_batch["agent_name"].tolist() == [MULTI_TURN_AGENT] * 4


def test_missing_n_names_the_path() -> None:
    config = {"actor_rollout_ref": {"rollout": {"multi_turn": {"enable": False}}}}
    with pytest.raises(trajtrack.ConfigurationError, match=r"'actor_rollout_ref.rollout.n'"):
        prepare_single_generation_data(batch_dict(), config)
    with pytest.raises(trajtrack.ConfigurationError, match=r"no 'actor_rollout_ref'"):
        prepare_single_generation_data(batch_dict(), SimpleNamespace())


@pytest.mark.parametrize("n", [0, -2, "4", 2.0, True])
def test_invalid_n(n: object) -> None:
    with pytest.raises(trajtrack.ConfigurationError, match="positive integer"):
        prepare_single_generation_data(batch_dict(), dict_config(n=n))


def test_uses_the_given_batch_class() -> None:
    out = prepare_single_generation_data(batch_dict(), dict_config(n=2), batch_cls=FakeDataProto)
    assert type(out) is FakeDataProto
    assert out.non_tensor_batch["agent_name"].tolist() == [SINGLE_TURN_AGENT] * 4
    assert out.batch["input_ids"][:, 0].tolist() == [11, 11, 21, 21]


def test_accepts_an_already_built_batch() -> None:
    built = FakeDataProto.from_single_dict(batch_dict())
    out = prepare_single_generation_data(built, dict_config(n=2))
    assert type(out) is FakeDataProto
    assert len(out) == 4


def test_verl_091_behaviour_on_request() -> None:
    # verl 0.9.1: "single_turn_agent" when multi-turn is off, no agent_name when it is on.
    single = prepare_single_generation_data(
        batch_dict(), dict_config(n=2, multi_turn=False), agent_name=VERL_091_SINGLE_TURN_AGENT
    )
    assert single.non_tensor_batch["agent_name"].tolist() == ["single_turn_agent"] * 4
    multi = prepare_single_generation_data(
        batch_dict(), dict_config(n=2, multi_turn=True), agent_name=NO_AGENT_NAME
    )
    assert "agent_name" not in multi.non_tensor_batch
    assert len(multi) == 4
    # and the seed's defaults stay what they were
    assert (
        prepare_single_generation_data(batch_dict(), dict_config(n=1, multi_turn=True))
        .non_tensor_batch["agent_name"]
        .tolist()
        == ["async_partial_tool_agent"] * 2
    )
