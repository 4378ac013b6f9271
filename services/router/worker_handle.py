"""One worker as the router knows it (`WorkerHandle`): its registration, a stub on its
address's shared channel, and the router's own count of what runs on it. The pool that
keeps them is `workers.py`."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import grpc.aio

from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc import baton_pb2_grpc as pb_grpc


@dataclass(eq=False)
class WorkerHandle:
    """One known worker: its registration, a stub on the shared channel, and the router's
    own count of requests running on it."""

    info: pb.WorkerInfo
    stub: pb_grpc.WorkerStub
    channel: grpc.aio.Channel | None = None  # the address's channel, shared (None in tests)
    in_flight: int = 0
    # prompt tokens of each request whose prompt it computes (P; D placed local), its first
    # token not back yet: its queue, or the slack they will spend, before the worker's
    # reports can show it (`Attempt.owe`)
    owed_prompts: list[int] = field(default_factory=list)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def prompt_tokens_owed(self) -> int:
        return sum(self.owed_prompts)

    @property
    def role(self) -> int:
        return self.info.role

    @property
    def load(self) -> float:
        """Router-side in-flight requests plus the worker's last reported running + queued."""
        return self.in_flight + self.info.load.running + self.info.load.queued

    def peer(self) -> pb.PeerInfo:
        return pb.PeerInfo(
            worker_id=self.info.worker_id,
            kv_control_address=self.info.kv_control_address,
            transfer_address=self.info.transfer_address,
        )

    def refused(self) -> bool:
        """Whether the worker's channel failed to connect: its address refuses connections
        (the process is gone), as opposed to a call the worker itself failed."""
        if self.channel is None:
            return False
        return self.channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE
