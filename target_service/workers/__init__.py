"""The target's tensor-parallel worker group: rank 0 serves, ranks 1..N-1 follow.

Rank 0 is the target service process itself: it owns the gRPC stream, the
sessions and the sampler, and runs its shard of the model through a
`TensorParallelRunner` (the `CausalLMRunner` interface, so the Verifier does
not change). Ranks 1..N-1 are followers started by an executor:

    mp   local processes (multiprocessing, spawn), the default
    ray  Ray actors in a placement group, one bundle per follower rank
         ({"CPU": 1, "GPU": 1} when --device is cuda, else {"CPU": 1}), PACK
         strategy so a group may span nodes; --ray-address joins a cluster

Followers mirror rank 0's forward passes and nothing else: before every
forward rank 0 broadcasts one small command (`commands`). Commands travel on
a gloo group (CPU objects) with a long timeout (followers sit idle in it
between requests); the model's collectives use the default group (gloo on
CPU, NCCL on GPU) with a short one, so a hung rank raises instead of hanging
the service. A failed follower or collective fails the group, which rank 0
rebuilds (`group`).

    rendezvous      WorkerSpec, the rendezvous store and the process groups (every rank)
    commands        the broadcast protocol, and a follower's Mirror of rank 0's sessions
    follower        a follower rank's process: load the shard, report ready, mirror forwards
    executor        the Executor interface and `make_executor`
    mp_executor     followers as local processes
    ray_executor    followers as Ray actors
    group           WorkerGroup: rank 0's side (form, command, watch, restart)
    runner          TensorParallelRunner (rank 0's CausalLMRunner) and `build_tp_runner`
"""
