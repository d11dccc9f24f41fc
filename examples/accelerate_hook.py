"""The DDP hook under Hugging Face Accelerate:
``torchrun --nproc-per-node 2 examples/accelerate_hook.py [--accumulate 4]`` (each step's batch
in ``--accumulate`` micro-batches)."""

import torch

from fashion import Net, batches, command_line, loss_fn, report

args = command_line(__doc__, accumulate=True)
# fmt: off
# [readme]
from accelerate import Accelerator
from lags_hvd.ddp import LAGSHookState, lags_hook

accelerator = Accelerator(gradient_accumulation_steps=args.accumulate, cpu=not torch.cuda.is_available())
model = accelerator.prepare(Net())
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * accelerator.num_processes, momentum=0.9)
state = LAGSHookState(named_parameters=accelerator.unwrap_model(model).named_parameters(), optimizer=optimizer,
                      density=0.001, grad_scaler=accelerator.scaler)  # fp16's GradScaler, else None
optimizer = accelerator.prepare(optimizer)   # after LAGSHookState wrapped it
model.register_comm_hook(state, lags_hook)

for x, y in batches(args, accelerator.process_index, accelerator.num_processes):
    for micro_x, micro_y in zip(x.chunk(args.accumulate), y.chunk(args.accumulate)):
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model(micro_x), micro_y))
            optimizer.step()           # Accelerate steps once per args.accumulate micro-batches
            optimizer.zero_grad()
# [/readme]
# fmt: on
report(args, "accelerate", accelerator.unwrap_model(model), accelerator.process_index)
