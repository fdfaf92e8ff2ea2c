"""Media files as their headers declare them: a sound's coding, rate and duration, and the
size of a media file carried in base64, read without decoding a sample or a pixel.

The daemon reads these before a runner is leased (bounds.py words the refusals as a
request's 400) and the runner reads them again before its decoder runs (engine/sound.py),
which is given only what was read here: a WAV file written from the format and samples
read, an MP3's frames end to end. An MP3 has no header for the whole file: its frames are
walked (their 4-byte headers only), so a bomb (a megabyte of minimal frames that decode to
hours) is measured, not decoded. Pure Python and the standard library: it sits at the
floor of the import layers, below the daemon's checks and the engine alike.
"""

from __future__ import annotations

import bisect
import re
import struct
from dataclasses import dataclass
from dataclasses import field as dataclass_field


def decoded_size(data: str) -> int:
    """The decoded size of a media file in canonical base64 (api/images.py makes every image
    and sound so), from its length alone: sizes are checked without decoding."""
    return len(data) // 4 * 3 - data[-2:].count("=")


# -- sound -----------------------------------------------------------------------------------

MAX_SOUND_SECONDS = 20 * 60  # a sound's declared duration (OpenAI transcribes 25 MB: ~25 min mp3)
MIN_RATE, MAX_RATE = 8_000, 48_000  # sample rates taken (telephone to studio)
MAX_CHANNELS = 8
SOUND_FORMATS = ("WAV", "MP3")
# The length of sound a projector encodes on its own, by its type (`clip.projector_type`):
# a sound is read as consecutive pieces of it, each encoded once, so a stream's pieces can
# be read as they arrive and give what the whole file gives. Qwen3-ASR's encoder (qwen3a)
# convolves chunks of 100 mel frames (10 ms each) and normalises over what it is given, so a
# piece's rows depend on nothing outside it; n samples give n / 160 + 1 frames at 16 kHz, so
# 0.98 s (99 frames, with room for the sample a resampler may add) fills one chunk, where
# 1 s (101 frames) would take two and twice the positions. Whisper-style encoders pad every
# input to 30 s (a short piece would cost a 30 s pass and its positions): they, and types
# not listed, read a sound whole.
SOUND_PIECE_SECONDS = {"qwen3a": 0.98}


def piece_frames(seconds: float, rate: int) -> int:
    """Sample frames in a piece of `seconds` at `rate` (rounded: 0.98 * 24000 is
    23519.99... in floating point)."""
    return max(1, round(seconds * rate))


# -- WAV: a RIFF file's format chunk says how its samples are coded, and dr_wav (miniaudio's
# WAV decoder, inside libmtmd) believes it: an ADPCM file (MS 0x0002, IMA 0x0011) decodes to
# about two samples a byte whatever its block alignment says, and a PCM file of whole bytes
# to data / (channels x bits / 8) frames whatever its block alignment says (measured: 80 KB
# of MS ADPCM declaring a 65,535-byte block, so 0.15 ms at data / block / rate, decoded to
# 20 s). So only codings whose length the header gives exactly are taken, each with the one
# block alignment and byte rate that coding has; a file that dr_wav would refuse (a bit
# depth of 0, say) is refused here too, because miniaudio then tries its MP3 decoder on the
# same bytes, which resyncs to any frames a data chunk holds (measured: 72 s decoded from a
# "WAV" declaring 0.1 ms). The runner hands the decoder a WAV file it writes itself from what
# was read here (engine/sound.py), so no chunk, second format chunk or extension field read
# differently by dr_wav can change what is decoded.

WAVE_FORMAT_EXTENSIBLE = 0xFFFE
# The codings taken: format tag -> (name, the bit depths dr_wav decodes). A-law and mu-law
# are one byte a sample: their length is as exact as PCM's.
WAV_CODINGS = {1: ("PCM", (8, 16, 24, 32)), 3: ("IEEE float", (32, 64)), 6: ("A-law", (8,)),
               7: ("mu-law", (8,))}
_WAV_NAMES = {2: "MS ADPCM", 0x11: "IMA ADPCM", 0x31: "GSM 6.10", 0x50: "MPEG",
              0x55: "MPEG layer III", 0x0161: "WMA"}
# KSDATAFORMAT_SUBTYPE_PCM and its kin: the format tag, then these 14 bytes
_SUBFORMAT_TAIL = bytes.fromhex("0000000010008000" "00aa00389b71")


@dataclass(frozen=True)
class WavLayout:
    """Where a WAV file's samples are and how they are coded, from its chunks' headers."""

    tag: int  # a key of WAV_CODINGS (an extensible file's subformat)
    channels: int
    rate: int
    bits: int
    start: int  # the samples' first byte
    size: int  # the samples' bytes, as the data chunk declares them

    @property
    def block(self) -> int:
        """Bytes of one frame (a sample of every channel)."""
        return self.channels * self.bits // 8

    @property
    def fmt(self) -> bytes:
        """The format chunk's body as the runner writes it for the decoder: the plain
        16-byte form of this coding (an extensible file's subformat as its tag)."""
        return struct.pack("<HHIIHH", self.tag, self.channels, self.rate,
                           self.rate * self.block, self.block, self.bits)

    @property
    def seconds(self) -> float:
        return self.size / self.block / self.rate


def _wav_coding(fmt: bytes) -> tuple[int, int, int, int]:
    """A format chunk's (tag, channels, rate, bits); ValueError, naming what is wrong, for a
    coding not in WAV_CODINGS or a block alignment or byte rate other than its own."""
    tag, channels, rate, byte_rate, block, bits = struct.unpack_from("<HHIIHH", fmt)
    named = f"0x{tag:04X}" + (f" ({_WAV_NAMES[tag]})" if tag in _WAV_NAMES else "")
    if tag == WAVE_FORMAT_EXTENSIBLE:
        # dr_wav refuses an extension of any other size (and reads no subformat without it)
        if len(fmt) < 40 or struct.unpack_from("<H", fmt, 16)[0] != 22:
            raise ValueError("a WAV file's extensible format chunk is truncated")
        guid = fmt[24:40]
        sub = struct.unpack_from("<H", guid)[0]
        tag = sub if guid[2:] == _SUBFORMAT_TAIL else -1
        named = f"extensible, subformat {guid.hex()}" if tag < 0 else \
            f"extensible, subformat 0x{sub:04X}" + (f" ({_WAV_NAMES[sub]})"
                                                   if sub in _WAV_NAMES else "")
    if tag not in WAV_CODINGS:
        accepted = ", ".join(f"{name} ({t})" for t, (name, _) in WAV_CODINGS.items())
        raise ValueError(f"a WAV file in format {named}: only {accepted} are accepted, "
                         "whose length the header gives")
    name, depths = WAV_CODINGS[tag]
    if bits not in depths:
        raise ValueError(f"a WAV file of {bits}-bit {name}: "
                         f"{', '.join(map(str, depths))}-bit {name} is accepted")
    if not 1 <= channels <= MAX_CHANNELS:
        raise ValueError(f"a WAV file with {channels} channels; 1 to {MAX_CHANNELS} "
                         "are accepted")
    _check_rate(rate)
    if block != channels * bits // 8:
        raise ValueError(f"a WAV file whose block alignment is {block} bytes: "
                         f"{channels} channel(s) of {bits}-bit {name} take "
                         f"{channels * bits // 8}")
    if byte_rate != rate * block:
        raise ValueError(f"a WAV file whose byte rate is {byte_rate}: {rate} Hz of "
                         f"{block}-byte frames make {rate * block}")
    return tag, channels, rate, bits


def wav_layout(data: bytes) -> WavLayout:
    """A WAV file's layout; ValueError for a coding, rate or channel count not taken, or a
    truncated file (one declaring no more than MAX_SOUND_SECONDS, which is refused anyway).
    As dr_wav does, the last format chunk before the first data chunk is the one read."""
    pos, fmt = 12, None
    while pos + 8 <= len(data):
        kind, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = pos + 8
        if kind == b"fmt ":
            if size < 16 or body + 16 > len(data):
                raise ValueError("a WAV file's format chunk is truncated")
            fmt = data[body:body + size]
        elif kind == b"data":
            if fmt is None:
                raise ValueError("a WAV file's samples come before its format")
            layout = WavLayout(*_wav_coding(fmt), start=body, size=size)
            if layout.seconds <= MAX_SOUND_SECONDS and body + size > len(data):
                raise ValueError(f"a WAV file is truncated: it declares {size} bytes of "
                                 f"samples and holds {len(data) - body}")
            return layout
        pos = body + size + (size & 1)  # chunks are padded to an even size
    raise ValueError("a WAV file without samples (no data chunk)")


# -- MP3: no header gives a whole file's length, so its frames are walked (4-byte headers,
# read as dr_mp3, miniaudio's MP3 decoder, reads them), and what is walked is what the
# decoder is given: the runner hands it only the frames found here, end to end (Mp3Layout.
# stream), never the file. A decoder scans past anything between frames for the next sync,
# so a walk that stopped at junk undercounted (measured: one 24 ms frame, a zero byte, then
# 2000 frames: 48 s decoded from a file declaring 24 ms), and one that resyncs its own way
# can be led astray by bytes that look like frames. Given only frames of one kind (one MPEG
# version, layer and sample rate: what dr_mp3's header comparison checks), each beginning
# where the last ends, dr_mp3 decodes exactly those frames: each is in sync with the next,
# and after a frame it cannot decode it finds the next at its first byte (its own search
# confirms a header by the frames that follow, and they all follow). So junk, tags and
# other files' frames are not counted because they are not decoded, and no tag reaches the
# decoders (miniaudio tries its FLAC decoder before dr_mp3, and it skips an ID3v2 tag by
# its own reading of the tag's size, then decodes any FLAC stream it finds). What dr_mp3
# reads from the frames other than audio is refused or counted: an end it would cut (a
# last frame whose bytes read as an ID3v1 or APE tag's), and a Xing/Info tag's frame count,
# which becomes the decoder's output length whatever the frames hold (measured: one frame
# claiming 60,000 frames decoded to 1440 s of samples; a count of 2^32 - 1 asks for
# terabytes), so the largest count a frame claims is counted.

# dr_mp3's bitrate table (kbit/s / 2) by [MPEG-1][layer bits - 1][bitrate index]; the layer
# bits are 3 for layer I, 2 for II, 1 for III
_HALFRATE = (
    ((0, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 72, 80),
     (0, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 72, 80),
     (0, 16, 24, 28, 32, 40, 48, 56, 64, 72, 80, 88, 96, 112, 128)),
    ((0, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160),
     (0, 16, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192),
     (0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224)),
)
# The first two bytes of a header dr_mp3 takes (ma_dr_mp3_hdr_valid): MPEG-1 and MPEG-2 of
# any layer, MPEG-2.5 of layer III only (a lookahead: in 0xFF 0xFF 0xFB, the header is the
# second 0xFF's)
_MP3_SYNC = re.compile(rb"\xff(?=[\xe2\xe3\xf2-\xf7\xfa-\xff])")
MP3_CONFIRM = 3  # frames that must follow a frame found after junk (or the end of the file)
MP3_MAX_MISSES = 4096  # sync-like bytes that are not frames: past these a file is refused


def _mp3_frames() -> list[tuple[int, int, int] | None]:
    """(bytes, samples, rate) of a frame by its header's second and third bytes
    (`b1 << 8 | b2`), as dr_mp3 computes them (ma_dr_mp3_hdr_frame_bytes, _padding,
    _frame_samples, _sample_rate_hz); None for a header dr_mp3 does not take and for free
    format (bitrate 0: no length in the header, a frame as short as its side information
    stands for 1152 samples)."""
    table: list[tuple[int, int, int] | None] = [None] * 65536
    for b1 in range(256):
        layer = b1 >> 1 & 3
        if not ((b1 & 0xF0) == 0xF0 or (b1 & 0xFE) == 0xE2) or not layer:
            continue
        mpeg1, not25 = b1 & 0x08, b1 & 0x10
        samples = 384 if layer == 3 else 576 if (b1 & 14) == 2 else 1152
        for b2 in range(256):
            bitrate, rate_index = b2 >> 4, b2 >> 2 & 3
            if bitrate in (0, 15) or rate_index == 3:
                continue
            rate = (44100, 48000, 32000)[rate_index] >> (not mpeg1) >> (not not25)
            n = samples * 2 * _HALFRATE[bool(mpeg1)][layer - 1][bitrate] * 125 // rate
            if layer == 3:
                n &= ~3
            if b2 & 2:
                n += 4 if layer == 3 else 1
            table[b1 << 8 | b2] = (n, samples, rate)
    return table


_MP3_FRAMES = _mp3_frames()


def _mp3_kind(b1: int, b2: int) -> int:
    """What dr_mp3's header comparison compares: version and layer, and sample rate."""
    return (b1 & 0xFE) << 8 | (b2 & 0x0C)


@dataclass(frozen=True)
class Mp3Layout:
    """An MP3 file's audio frames, as its walk found them."""

    rate: int
    samples: int  # samples (per channel) in a frame: 384, 576 or 1152
    frames: int  # frames found (the walk stops once they pass MAX_SOUND_SECONDS)
    claimed: int  # the largest frame count a Xing/Info tag in a frame claims
    # the frames end to end are source[start:end] (none if the walk stopped early): the
    # file itself where its frames are one stretch, so the daemon's check copies nothing
    source: bytes = dataclass_field(default=b"", repr=False, compare=False)
    start: int = 0
    end: int = 0

    @property
    def seconds(self) -> float:
        return max(self.frames, self.claimed) * self.samples / self.rate

    def stream(self) -> bytes:
        """The frames end to end: what the decoder is given, never the file."""
        return self.source[self.start:self.end]


def _mp3_bounds(data: bytes) -> tuple[int, int]:
    """Where an MP3 file's frames may be: after its ID3v2 tags, before an APE and an ID3v1
    tag at its end (dr_mp3 skips the same; a tag elsewhere is walked past as junk)."""
    start = 0
    while data[start:start + 3] == b"ID3" and start + 10 <= len(data):
        size = 0
        for b in data[start + 6:start + 10]:  # 4 x 7 bits
            size = size << 7 | (b & 0x7F)
        start += 10 + size + (10 if data[start + 5] & 0x10 else 0)  # an ID3v2.4 footer
    if start > len(data):
        raise ValueError("an MP3 file whose ID3v2 tag runs past its end")
    end = len(data)
    if end - start >= 128 and data[end - 128:end - 125] == b"TAG":
        end -= 128
    if end - start >= 32 and data[end - 32:end - 24] == b"APETAGEX":  # a footer
        size, flags = struct.unpack_from("<I", data, end - 20)[0], data[end - 9]
        size += 32 if flags & 0x80 else 0  # and a header
        if 32 <= size <= end - start:
            end -= size
    return start, end


def _mp3_confirmed(data: bytes, at: int, end: int, kind: int) -> bool:
    """Whether a frame at `at` is followed by MP3_CONFIRM frames of its kind, or by frames
    of its kind up to `end` (less than a header left)."""
    for _ in range(MP3_CONFIRM + 1):
        if end - at < 4:
            return True
        b1, b2 = data[at + 1], data[at + 2]
        frame = _MP3_FRAMES[b1 << 8 | b2]
        if data[at] != 0xFF or frame is None or _mp3_kind(b1, b2) != kind \
                or at + frame[0] > end:
            return False
        at += frame[0]
    return True


def mp3_layout(data: bytes) -> Mp3Layout:
    """An MP3 file's frames; ValueError for a file without any, or with frames of two kinds
    (a change of MPEG version, layer or sample rate), or junk that looks like frames past
    MP3_MAX_MISSES, or what dr_mp3 would read from it other than its frames."""
    start, end = _mp3_bounds(data)
    runs: list[tuple[int, int]] = []  # stretches of consecutive frames
    starts: list[int] = []  # each frame's first byte in the stream
    kind = samples = rate = frames = length = misses = 0
    most = 0.0  # frames in MAX_SOUND_SECONDS
    free = False
    pos = start
    while True:
        # the next frame: at `pos` if it is one of the kind, else the next sync a frame
        # confirms (frames of another kind that confirm themselves: refused)
        at = -1
        for m in _MP3_SYNC.finditer(data, pos, end):
            q = m.start()
            if q + 4 > end:
                break
            b1, b2 = data[q + 1], data[q + 2]
            frame = _MP3_FRAMES[b1 << 8 | b2]
            if frame is not None:
                k = _mp3_kind(b1, b2)
                if (not kind or k == kind) and _mp3_confirmed(data, q, end, k):
                    at = q
                    break
                if kind and k != kind and _mp3_confirmed(data, q, end, k):
                    raise ValueError("an MP3 file whose frames change MPEG version, layer or "
                                     "sample rate is not accepted")
            elif b2 >> 4 == 0 and b2 >> 2 & 3 != 3:
                free = True
            misses += 1
            if misses > MP3_MAX_MISSES:
                raise ValueError(f"an MP3 file with more than {MP3_MAX_MISSES} frame "
                                 "headers that no frames follow")
        if at < 0:
            break
        if not kind:
            b1, b2 = data[at + 1], data[at + 2]
            kind = _mp3_kind(b1, b2)
            _, samples, rate = _MP3_FRAMES[b1 << 8 | b2]  # type: ignore[misc]
            _check_rate(rate)
            most = MAX_SOUND_SECONDS * rate / samples
        run = pos = at
        while end - pos >= 4:  # the frames that follow, each where the last ends
            b1, b2 = data[pos + 1], data[pos + 2]
            frame = _MP3_FRAMES[b1 << 8 | b2]
            if data[pos] != 0xFF or frame is None or (b1 & 0xFE) << 8 | (b2 & 0x0C) != kind \
                    or pos + frame[0] > end:  # (_mp3_kind, inline: the walk's hot loop)
                break
            starts.append(length + pos - run)
            pos += frame[0]
            frames += 1
            if frames > most:  # enough to refuse it
                return Mp3Layout(rate, samples, frames, 0)
        runs.append((run, pos))
        length += pos - run
    if not frames:
        raise ValueError("free-format MP3 is not accepted" if free else
                         "an MP3 file without audio frames")
    if len(runs) == 1:
        (a, b), source = runs[0], data
    else:
        a, b, source = 0, length, b"".join(data[a:b] for a, b in runs)
    if (length > 128 and source[b - 128:b - 125] == b"TAG") \
            or (length > 32 and source[b - 32:b - 24] == b"APETAGEX"):
        raise ValueError("an MP3 file whose last frame ends as an ID3v1 or APE tag does "
                         "(its decoder would cut it there)")
    return Mp3Layout(rate, samples, frames, _mp3_claimed(source, a, b, starts), source, a, b)


def _mp3_claimed(source: bytes, a: int, b: int, starts: list[int]) -> int:
    """The largest frame count a Xing or Info tag claims in the frames `source[a:b]`, whose
    frames start at `starts` (from `a`), read where dr_mp3 reads it: after a frame's header,
    CRC and layer III side information (for any layer: dr_mp3 does not look at it), in the
    stream's bytes (a short frame's tag runs into the next). dr_mp3 reads only the first
    frame it decodes; which that is depends on the frames' contents, so every frame's is
    read."""
    claimed = 0
    for at in _found(source, b"Xing", a, b) + _found(source, b"Info", a, b):
        first = bisect.bisect_right(starts, at - a) - 1
        for s in starts[max(0, first - 2):first + 1]:  # a tag is at most 38 bytes in
            s += a
            mono = source[s + 3] & 0xC0 == 0xC0
            side = (17 if mono else 32) if source[s + 1] & 0x08 else (9 if mono else 17)
            if s + 4 + (0 if source[s + 1] & 1 else 2) + side != at:
                continue
            if at + 12 > b:
                raise ValueError("an MP3 file whose last frame holds a cut-off Xing tag")
            if source[at + 7] & 1:  # the frame count is there
                claimed = max(claimed, struct.unpack_from(">I", source, at + 8)[0])
    return claimed


def _found(data: bytes, word: bytes, a: int, b: int) -> list[int]:
    """Where `word` is in `data[a:b]` (bytes.find, no copy; a regular expression of two
    words takes four times as long)."""
    out, at = [], data.find(word, a, b)
    while at >= 0:
        out.append(at)
        at = data.find(word, at + 1, b)
    return out


SoundLayout = WavLayout | Mp3Layout


def sound_layout(data: bytes) -> SoundLayout:
    """A WAV or MP3 file's layout, read from its headers alone; ValueError for another
    format, a coding, rate or channel count not taken, or a truncated file."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return wav_layout(data)
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return mp3_layout(data)
    raise ValueError(f"not a sound file in a supported format ({', '.join(SOUND_FORMATS)})")


def sound_seconds(data: bytes) -> float:
    """The seconds a WAV or MP3 file declares (sound_layout)."""
    return sound_layout(data).seconds


def check_sound(data: bytes) -> SoundLayout:
    """The layout of the sound file `data`; ValueError for another format, a coding, rate or
    channel count not taken, a truncated file or more than MAX_SOUND_SECONDS."""
    layout = sound_layout(data)
    if layout.seconds > MAX_SOUND_SECONDS:
        raise ValueError(f"the sound declares {layout.seconds:.0f} s of audio; at most "
                         f"{MAX_SOUND_SECONDS} s are accepted")
    return layout


def _check_rate(rate: int) -> None:
    if not MIN_RATE <= rate <= MAX_RATE:
        raise ValueError(f"a sound file's sample rate is {rate} Hz; {MIN_RATE} to {MAX_RATE} "
                         "Hz are accepted")

