"""Vision: images and videos in requests, and the vision-language models.

`media` (with `source`, `fetch`, `decode`, `video`, `limits`) fetches and decodes what a
request names; `load` reads a VLM folder with mlx-vlm and wraps its language model for the
engine; `inputs` is the plain data a request's images become (it crosses to an engine
process); `prompt` turns a rendered prompt and its images into token ids and that data (API
side); `encoder` runs the vision tower as its own batched step, with a cache by content.
"""
