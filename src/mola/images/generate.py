"""One batched denoising loop: mflux 0.24.0's ``Flux2Klein.generate_image`` for
text to image, made batched. Each row has its own prompt, its own seed and its
own LoRA slot and scale (``routing.set`` before the loop); rows share the size
and the number of steps. Kept step for step with mflux's, so that a row's image
is the one mflux makes for that request alone (tests/test_images.py checks it):

    mflux generate_image                     here
    Config(model_config, steps, h, w, 1.0)   the same
    _encode_prompt_pair (guidance 1.0:       Flux2PromptEncoder.encode_prompt of the
      no negative prompt)                      rows' prompts at once
    prepare_packed_latents(seed, batch 1)    the same per row, concatenated
    predict = mx.compile(transformer ...)    the same (not compiled on M1/M2, as mflux)
    scheduler.step per t, mx.eval            the same (no progress bar)
    vae.decode_packed_latents                the same, all rows at once
    ImageUtil.to_image -> PIL                ImageUtil.to_pil per row

Not here: img2img, guidance above 1 (klein is guidance-distilled), PID decoding, tiling.
Worker thread only.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .base import ImageBase

TEXT_ENCODER_OUT_LAYERS = (9, 18, 27)  # as mflux's Flux2Klein._encode_prompt_pair
MAX_SEQUENCE_LENGTH = 512


@dataclass(frozen=True)
class Row:
    """One image of a batch."""

    prompt: str
    seed: int
    slot: int  # 0: no LoRA
    row_scale: float  # multiplies the slot's delta (1.0 for a stack, whose scales are in its slot)


def generate(base: ImageBase, rows: list[Row], width: int, height: int, steps: int) -> list:
    """PIL images, one per row, of ``width`` x ``height`` after ``steps`` steps."""
    from mflux.models.common.config.config import Config
    from mflux.models.flux2.latent_creator.flux2_latent_creator import (
        Flux2LatentCreator,
    )
    from mflux.models.flux2.model.flux2_text_encoder.prompt_encoder import (
        Flux2PromptEncoder,
    )
    from mflux.utils.apple_silicon import AppleSiliconUtil
    from mflux.utils.image_util import ImageUtil

    model = base.model
    config = Config(model_config=model.model_config, num_inference_steps=steps, height=height, width=width,
                    guidance=1.0, image_path=None, image_strength=None, scheduler="flow_match_euler_discrete")
    prompt_embeds, text_ids = Flux2PromptEncoder.encode_prompt(
        prompt=[r.prompt for r in rows], tokenizer=model.tokenizers["qwen3"], text_encoder=model.text_encoder,
        num_images_per_prompt=1, max_sequence_length=MAX_SEQUENCE_LENGTH,
        text_encoder_out_layers=TEXT_ENCODER_OUT_LAYERS)  # [B, 512, 3 * hidden], [B, 512, 4]
    noise = []
    for r in rows:  # each row's noise is what a request alone with that seed starts from
        latents, latent_ids, latent_h, latent_w = Flux2LatentCreator.prepare_packed_latents(
            seed=r.seed, height=height, width=width, batch_size=1)  # [1, h*w/256, 128], [1, h*w/256, 4]
        noise.append(latents)
    latents = mx.concatenate(noise, axis=0)  # [B, h*w/256, 128]
    latent_ids = mx.broadcast_to(latent_ids, (len(rows), *latent_ids.shape[1:]))  # [B, h*w/256, 4]
    base.routing.set([r.slot for r in rows], [r.row_scale for r in rows])

    def predict(latents: mx.array, timestep: mx.array) -> mx.array:
        return model.transformer(hidden_states=latents, encoder_hidden_states=prompt_embeds, timestep=timestep,
                                 img_ids=latent_ids, txt_ids=text_ids, guidance=None)

    step = predict if AppleSiliconUtil.is_m1_or_m2() else mx.compile(predict)
    for t in range(config.init_time_step, config.num_inference_steps):  # mflux's time_steps, without its tqdm bar
        noise_pred = step(latents, config.scheduler.timesteps[t])
        latents = config.scheduler.step(noise=noise_pred, timestep=t, latents=latents, sigmas=config.scheduler.sigmas)
        mx.eval(latents)
    packed = latents.reshape(len(rows), latent_h, latent_w, latents.shape[-1]).transpose(0, 3, 1, 2)
    decoded = model.vae.decode_packed_latents(packed, tiling_config=model.tiling_config)  # [B, 3, H, W] in [-1, 1]
    mx.eval(decoded)
    base.routing.clear()
    return [ImageUtil.to_pil(decoded[i:i + 1]) for i in range(len(rows))]
