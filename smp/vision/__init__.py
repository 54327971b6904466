"""Vision and multimodal models under smp: the image path run on every rank when some ranks'
batches hold no image (`mixed_batches`), and the contrastive loss over the global batch
(`contrastive`: CLIP, SigLIP)."""

from smp.vision.contrastive import clip_loss, gather_with_grad, siglip_loss
from smp.vision.mixed_batches import image_paths, install_image_path_on_every_rank

__all__ = ["clip_loss", "gather_with_grad", "image_paths", "install_image_path_on_every_rank", "siglip_loss"]
