"""Vision: images and videos in requests (`media`), and the vision-language models."""
