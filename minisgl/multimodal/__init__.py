"""Images for vision-language models: references read into PIL images (`media`), the families' image
preprocessing (`qwen_vl`) and the media settings (`config`). docs/vision.md."""
