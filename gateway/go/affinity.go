package main

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"math"
	"os"
	"strings"

	epdv1 "epd/sdk/go/epd/v1"
)

// affinityKeys: where on a stage's ring a piece of work lands. A keyed MAC (GMAC: AES-GCM over
// the bytes as additional data) of what identifies the work, not a plain hash: a megabyte costs
// it under 0.1 ms here against 2.3 ms for SHA-256, and without the key a client cannot craft
// distinct items that pile onto one instance's point. Gateway replicas route an item alike
// only when they share the key (--affinity-key-file).
type affinityKeys struct {
	gcm   cipher.AEAD
	nonce []byte
}

// newAffinityKeys keys the MAC with the SHA-256 of the file's content, or with random bytes of
// this process's own when path is "".
func newAffinityKeys(path string) (*affinityKeys, error) {
	secret := make([]byte, 32)
	if path == "" {
		if _, err := rand.Read(secret); err != nil {
			return nil, err
		}
	} else {
		content, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("cannot read the affinity key file %q: %v", path, err)
		}
		if len(strings.TrimSpace(string(content))) == 0 {
			return nil, fmt.Errorf("the affinity key file %q is empty", path)
		}
		digest := sha256.Sum256([]byte(strings.TrimSpace(string(content))))
		secret = digest[:]
	}
	block, err := aes.NewCipher(secret[:16])
	if err != nil {
		return nil, err
	}
	gcm, err := cipher.NewGCM(block)
	if err != nil {
		return nil, err
	}
	return &affinityKeys{gcm: gcm, nonce: secret[16 : 16+gcm.NonceSize()]}, nil
}

func (a *affinityKeys) mac(data []byte) []byte { return a.gcm.Seal(nil, a.nonce, nil, data) }

// item: the key of a media item: its payload and every option that shapes its embedding.
func (a *affinityKeys) item(item *epdv1.MediaItem) uint64 {
	var manifest []byte
	file := func(f *epdv1.Media) { manifest = append(append(manifest, "file"...), a.mac(f.GetData())...) }
	switch media := item.GetMedia().(type) {
	case *epdv1.MediaItem_Image:
		file(media.Image)
	case *epdv1.MediaItem_Video:
		switch source := media.Video.GetSource().(type) {
		case *epdv1.Video_File:
			file(source.File)
		case *epdv1.Video_Frames:
			manifest = binary.LittleEndian.AppendUint64(append(manifest, "frames"...), math.Float64bits(source.Frames.GetFps()))
			for _, frame := range source.Frames.GetFrames() {
				file(frame)
			}
		}
		sampling := media.Video.GetSampling()
		manifest = binary.LittleEndian.AppendUint64(append(manifest, "sampling"...), math.Float64bits(sampling.GetFps()))
		manifest = binary.LittleEndian.AppendUint32(manifest, sampling.GetMaxFrames())
	case *epdv1.MediaItem_Audio:
		switch source := media.Audio.GetSource().(type) {
		case *epdv1.Audio_File:
			file(source.File)
		case *epdv1.Audio_Pcm:
			pcm := source.Pcm
			manifest = append(manifest, fmt.Sprintf("pcm %d %d %d", pcm.GetEncoding(), pcm.GetSampleRateHz(), pcm.GetChannels())...)
			manifest = append(manifest, a.mac(pcm.GetData())...)
		}
	}
	return keyOf(a.mac(manifest))
}

// textPrefixChars: how much of a chat without media keys its prefill.
const textPrefixChars = 256

// prefix: the key of what a prefill instance's caches could reuse for a request: the chat up
// to its first item, and that item (vLLM's prefix cache then holds the KV of both, its encoder
// cache the item), or, with no item, the chat's first characters. The turns of one chat share
// it, as do requests with one system prompt and image; bounded load keeps a hot key from
// overloading one prefill.
func (a *affinityKeys) prefix(chat []*epdv1.EngineChatMessage, firstItemHash string) uint64 {
	var prefix strings.Builder
	for _, message := range chat {
		for _, part := range message.GetParts() {
			if _, isItem := part.GetContent().(*epdv1.EngineChatPart_Item); isItem {
				return keyOf(a.mac([]byte(firstItemHash + ":" + prefix.String())))
			}
			fmt.Fprintf(&prefix, "%d:%s\x00", message.GetRole(), part.GetText())
		}
	}
	text := []rune(prefix.String())
	if len(text) > textPrefixChars {
		text = text[:textPrefixChars]
	}
	return keyOf(a.mac([]byte(string(text))))
}
