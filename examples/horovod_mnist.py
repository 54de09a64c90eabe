"""Horovod's PyTorch MNIST example (examples/pytorch/pytorch_mnist.py, 0.28.1) on mpitrain.

The script keeps that example's structure, options and Horovod calls; two things differ:

* the import: ``import mpitrain.horovod as hvd`` where Horovod has ``import horovod.torch as hvd``;
* the data: scikit-learn's 8x8 digits (no network here), upsampled to 28x28 so the MNIST network is
  unchanged, instead of torchvision's MNIST download.

Run:  mpitrain run -n 2 -- python examples/horovod_mnist.py --epochs 10
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import mpitrain.horovod as hvd

parser = argparse.ArgumentParser(description="PyTorch MNIST-style example on scikit-learn digits")
parser.add_argument("--batch-size", type=int, default=64, help="input batch size for training (default: 64)")
parser.add_argument("--test-batch-size", type=int, default=1000, help="input batch size for testing")
parser.add_argument("--epochs", type=int, default=10, help="number of epochs to train (default: 10)")
parser.add_argument("--lr", type=float, default=0.01, help="learning rate (default: 0.01)")
parser.add_argument("--momentum", type=float, default=0.5, help="SGD momentum (default: 0.5)")
parser.add_argument("--seed", type=int, default=42, help="random seed (default: 42)")
parser.add_argument("--log-interval", type=int, default=10, help="batches between training log lines")
parser.add_argument("--fp16-allreduce", action="store_true", default=False, help="fp16 compression of gradients")
parser.add_argument("--use-adasum", action="store_true", default=False, help="Adasum reduction (refused here)")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0, help="gradient predivide factor")


class Digits28(torch.utils.data.Dataset):
    """scikit-learn's digits as 1x28x28 float images (bilinear upsampling), normalised, with a fixed
    80/20 train/test split that is the same on every rank."""

    def __init__(self, train: bool) -> None:
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
        x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
        x = (x - x.mean()) / x.std()
        y = torch.tensor(d.target, dtype=torch.long)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
        cut = len(y) * 4 // 5
        keep = order[:cut] if train else order[cut:]
        self.x, self.y = x[keep], y[keep]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Net(nn.Module):
    """The network of Horovod's MNIST example: two convolutions, dropout, two linear layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = F.relu(self.fc1(x.view(-1, 320)))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def main(args):
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # one compute thread per rank, as the original

    train_dataset = Digits28(train=True)
    # each rank trains on its partition of the data
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset, num_replicas=hvd.size(),
                                                                    rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_dataset = Digits28(train=False)
    test_sampler = torch.utils.data.distributed.DistributedSampler(test_dataset, num_replicas=hvd.size(),
                                                                   rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)

    model = Net()
    lr_scaler = hvd.size() if not args.use_adasum else 1  # the effective batch grows with the ranks
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # start every rank from rank 0's weights and optimizer state
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)

    def train_epoch(epoch):
        model.train()
        train_sampler.set_epoch(epoch)  # reshuffle the partitions each epoch
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0:
                print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)} "
                      f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}")

    def metric_average(val, name):
        return hvd.allreduce(torch.tensor(val), name=name).item()

    def test():
        model.eval()
        test_loss, test_accuracy = 0.0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                pred = output.max(1, keepdim=True)[1]
                test_accuracy += pred.eq(target.view_as(pred)).float().sum().item()
        # per-rank means over this rank's partition, then averaged over the ranks
        test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
        test_accuracy = metric_average(test_accuracy / len(test_sampler), "avg_accuracy")
        if hvd.rank() == 0:
            print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * test_accuracy:.2f}%\n")

    for epoch in range(1, args.epochs + 1):
        train_epoch(epoch)
        test()


if __name__ == "__main__":
    main(parser.parse_args())
