"""The PyTorch peer's training step on a CUDA GPU, for images/s beside `cargo xtask bench`.

Imports the peer's model, target assignment, loss and optimizer (`torch_ssd_mobilenet_v1.py`
in PEER_DIR, a copy of ../shared/bench/peer/) and times its step (assign, forward, loss,
backward, RMSProp) on `cuda:0` at the given batch sizes, synchronising the GPU around each
step. The peer's target assignment indexes with host tensors, so it runs on the CPU, as the
peer writes it, and its targets are copied to the GPU within the timed step. TF32 is stated:
PyTorch's default is TF32 off for matrix products and on for cuDNN convolutions; `--tf32 off`
turns both off (the precision of our float32 kernels). `--amp` runs the forward pass and the
loss under autocast to bfloat16 (mixed precision as users turn it on; no loss scaling needed).

    python3 scripts/torch_gpu_step.py PEER_DIR [--batch 12 24] [--tf32 default|off] [--amp]

Prints one JSON line.
"""

import argparse
import json
import statistics
import sys
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("peer_dir")
    parser.add_argument("--batch", type=int, nargs="+", default=[12, 24])
    parser.add_argument("--tf32", choices=["default", "off"], default="default")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--amp", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, args.peer_dir)
    import torch
    import torch_ssd_mobilenet_v1 as peer

    if args.tf32 == "off":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda:0")
    # the feature maps of the 300x300 input, as the peer's own benchmark builds its anchors
    anchors = peer.ssd_anchors([(19, 19), (10, 10), (5, 5), (3, 3), (2, 2), (1, 1)])
    results = []
    for batch in args.batch:
        torch.manual_seed(0)
        model = peer.SSDMobileNetV1().train().to(device)
        opt = peer.make_optimizer(model)
        gen = torch.Generator().manual_seed(batch)
        pool = []
        for _ in range(3):
            images, *boxes = peer.random_batch(batch, gen)
            pool.append((images.to(device), *boxes))
        times = []
        for step in range(args.warmup + args.steps):
            images, gt_boxes, gt_classes, gt_valid = pool[step % len(pool)]
            torch.cuda.synchronize()
            start = time.perf_counter()
            targets = peer.assign_targets(gt_boxes, gt_classes, gt_valid, anchors)
            class_t, box_t, positive = (t.to(device) for t in targets)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp):
                box_codes, logits = model(images)
                cls_loss, loc_loss = peer.ssd_loss(box_codes, logits, class_t, box_t, positive)
            opt.zero_grad(set_to_none=True)
            (cls_loss + loc_loss).backward()
            opt.step()
            torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        step_s = statistics.median(times)
        results.append({"batch": batch, "images_per_s": round(batch / step_s, 1), "step_ms": round(1000 * step_s, 2)})
    print(json.dumps({
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "amp_bfloat16": args.amp,
        "results": results,
    }))


if __name__ == "__main__":
    main()
