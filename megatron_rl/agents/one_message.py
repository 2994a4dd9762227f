"""One engine call per prompt: for tasks scored on the tokens themselves."""

from __future__ import annotations

from megatron_rl.agents.base import BaseAgent, Commit, Messages, Resume
from megatron_rl.engines.base import GenerateRequest, RolloutEngine
from megatron_rl.records.trajectory import Trajectory, Turn


class OneMessageAgent(BaseAgent):
    """One engine call from a chat prompt, kept as generated (cut or not): for tasks scored on
    the tokens themselves."""

    role = "agent"

    async def run(self, question: str, reference: str | None, engine: RolloutEngine, *,
                  group_id: str, uid: str, resume: Resume | None = None,
                  commit: Commit | None = None, messages: Messages | None = None
                  ) -> Trajectory:
        traj, _ = self.start(question, reference, group_id, uid, resume)
        if traj.turns:  # its one message was committed before a cut
            return traj
        context = (self.chat.chat_ids(messages) if messages
                   else self.chat.prompt_ids("", self.chat.safe_text(question)))
        rid = f"{uid}/0"
        res = await engine.generate(GenerateRequest(
            rid, context, self.sampling_for(rid),
            return_routed_experts=self.config.return_routed_experts))
        traj.turns.append(Turn(self.role, context, list(res.output_ids),
                               list(res.output_logprobs), list(res.weight_versions),
                               finish_reason=res.finish_reason,
                               text=self.chat.decode(res.output_ids),
                               routed_experts=self.routed_experts(rid, res)))
        return traj
