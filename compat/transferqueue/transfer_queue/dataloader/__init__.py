from transfer_queue.dataloader.streaming_dataloader import StreamingDataLoader
from transfer_queue.dataloader.streaming_dataset import StreamingDataset

__all__ = ["StreamingDataLoader", "StreamingDataset"]
