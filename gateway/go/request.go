package main

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"math"
	"sort"
	"strings"

	epdv1 "epd/sdk/go/epd/v1"
)

// The public request's rules, as epd.wire and epd.media state them for every EPD service;
// tests/test_go_gateway.py holds the two gateways to the same statuses and field paths.
const (
	maxTemperature = 2.0  // OpenAI's range: above it sampling is noise
	minFrameRate   = 0.01 // outside these, timestamps and frame counts turn absurd
	maxFrameRate   = 1000.0
)

var supportedMimeTypes = map[epdv1.Modality][]string{
	epdv1.Modality_MODALITY_IMAGE: {"image/bmp", "image/gif", "image/jpeg", "image/jpg", "image/png", "image/webp"},
	epdv1.Modality_MODALITY_VIDEO: {"video/mp4", "video/quicktime", "video/webm", "video/x-matroska", "video/x-msvideo"},
	epdv1.Modality_MODALITY_AUDIO: {"audio/flac", "audio/vnd.wave", "audio/wav", "audio/wave", "audio/x-flac", "audio/x-wav"},
}

// mediaLimits: what one request may carry (the encoder checks what needs decoding).
type mediaLimits struct {
	maxItemBytes    int64
	maxRequestBytes int64
}

// mediaItem is one validated media part: what the encoder gets, where it sits in the public
// request (stage errors name items[i]; clients see this path), and its payload size.
type mediaItem struct {
	item     *epdv1.MediaItem
	modality epdv1.Modality
	path     string // messages[m].parts[p]
	nbytes   int64
}

// request is a validated GenerateRequest: the chat the engines render (text, and a marker
// where each item goes), the media for the encoders, in order, and the sampling parameters.
type request struct {
	id       string
	chat     []*epdv1.EngineChatMessage
	media    []mediaItem
	sampling *epdv1.SamplingParams
}

// parseRequest validates a public request, reporting every problem at once, then applies the
// size limits that need no decoding.
func parseRequest(msg *epdv1.GenerateRequest, limits mediaLimits, maxPromptBytes int) (*request, *requestError) {
	var violations []violation
	add := func(field, format string, args ...interface{}) {
		violations = append(violations, violation{field, fmt.Sprintf(format, args...)})
	}
	r := &request{id: msg.GetRequestId(), sampling: msg.GetSampling()}
	hasContent := false
	textBytes := 0
	if len(msg.GetMessages()) == 0 {
		add("messages", "must contain at least one message")
	}
	for mi, message := range msg.GetMessages() {
		role := message.GetRole()
		switch role {
		case epdv1.Role_ROLE_UNSPECIFIED:
			role = epdv1.Role_ROLE_USER
		case epdv1.Role_ROLE_SYSTEM, epdv1.Role_ROLE_USER, epdv1.Role_ROLE_ASSISTANT:
		default:
			add(fmt.Sprintf("messages[%d].role", mi), "unknown role %d", int32(role))
			role = epdv1.Role_ROLE_USER
		}
		if len(message.GetParts()) == 0 {
			add(fmt.Sprintf("messages[%d].parts", mi), "must contain at least one part")
		}
		parts := make([]*epdv1.EngineChatPart, 0, len(message.GetParts()))
		for pi, part := range message.GetParts() {
			field := fmt.Sprintf("messages[%d].parts[%d]", mi, pi)
			var item mediaItem
			switch content := part.GetContent().(type) {
			case nil:
				add(field, "has no content")
				continue
			case *epdv1.ContentPart_Text:
				hasContent = hasContent || strings.TrimSpace(content.Text) != ""
				textBytes += len(content.Text)
				parts = append(parts, &epdv1.EngineChatPart{Content: &epdv1.EngineChatPart_Text{Text: content.Text}})
				continue
			case *epdv1.ContentPart_Image:
				item = mediaItem{item: &epdv1.MediaItem{Media: &epdv1.MediaItem_Image{Image: content.Image}}, modality: epdv1.Modality_MODALITY_IMAGE}
				item.nbytes = checkFile(content.Image, field+".image", add)
			case *epdv1.ContentPart_Video:
				item = mediaItem{item: &epdv1.MediaItem{Media: &epdv1.MediaItem_Video{Video: content.Video}}, modality: epdv1.Modality_MODALITY_VIDEO}
				item.nbytes = checkVideo(content.Video, field+".video", add)
			case *epdv1.ContentPart_Audio:
				item = mediaItem{item: &epdv1.MediaItem{Media: &epdv1.MediaItem_Audio{Audio: content.Audio}}, modality: epdv1.Modality_MODALITY_AUDIO}
				item.nbytes = checkAudio(content.Audio, field+".audio", add)
			}
			hasContent = true
			item.path = field
			r.media = append(r.media, item)
			parts = append(parts, &epdv1.EngineChatPart{Content: &epdv1.EngineChatPart_Item{Item: item.modality}})
		}
		r.chat = append(r.chat, &epdv1.EngineChatMessage{Role: role, Parts: parts})
	}
	if len(msg.GetMessages()) > 0 && !hasContent {
		add("messages", "the prompt is empty: no text and no media")
	}
	violations = append(violations, samplingViolations(msg.GetSampling())...)
	if len(violations) > 0 {
		return nil, invalidArgument("invalid GenerateRequest: ", violations)
	}
	if err := checkSizes(r.media, limits); err != nil {
		return nil, err
	}
	if maxPromptBytes > 0 && textBytes > maxPromptBytes {
		return nil, fieldError("messages", fmt.Sprintf("hold %d bytes of text, over the gateway's limit of %d (--max-prompt-bytes)", textBytes, maxPromptBytes))
	}
	if r.id == "" {
		r.id = newRequestID()
	}
	return r, nil
}

type addViolation func(field, format string, args ...interface{})

// checkFile checks that an encoded file has bytes and a MIME type (checkSizes checks which); its size.
func checkFile(file *epdv1.Media, field string, add addViolation) int64 {
	if len(file.GetData()) == 0 {
		add(field+".data", "is empty")
	}
	if file.GetMimeType() == "" {
		add(field+".mime_type", "is required")
	}
	return int64(len(file.GetData()))
}

func checkVideo(video *epdv1.Video, field string, add addViolation) int64 {
	var nbytes int64
	switch source := video.GetSource().(type) {
	case nil:
		add(field+".source", "is required: set file or frames")
	case *epdv1.Video_File:
		nbytes = checkFile(source.File, field+".file", add)
	case *epdv1.Video_Frames:
		frames := source.Frames
		if len(frames.GetFrames()) == 0 {
			add(field+".frames.frames", "must contain at least one frame")
		}
		if !(frames.GetFps() >= minFrameRate && frames.GetFps() <= maxFrameRate) { // also refuses NaN
			add(field+".frames.fps", "must be between %s and %s frames per second", pyFloat(minFrameRate), pyFloat(maxFrameRate))
		}
		for k, frame := range frames.GetFrames() {
			nbytes += checkFile(frame, fmt.Sprintf("%s.frames.frames[%d]", field, k), add)
		}
	}
	if video.GetSource() != nil {
		if fps := video.GetSampling().GetFps(); !(fps == 0 || (fps >= minFrameRate && fps <= maxFrameRate)) {
			add(field+".sampling.fps", "must be 0 (the model's default) or between %s and %s", pyFloat(minFrameRate), pyFloat(maxFrameRate))
		}
	}
	return nbytes
}

func checkAudio(audio *epdv1.Audio, field string, add addViolation) int64 {
	switch source := audio.GetSource().(type) {
	case nil:
		add(field+".source", "is required: set file or pcm")
	case *epdv1.Audio_File:
		return checkFile(source.File, field+".file", add)
	case *epdv1.Audio_Pcm:
		pcm := source.Pcm
		if len(pcm.GetData()) == 0 {
			add(field+".pcm.data", "is empty")
		}
		if pcm.GetSampleRateHz() == 0 {
			add(field+".pcm.sample_rate_hz", "is required")
		}
		if pcm.GetChannels() == 0 {
			add(field+".pcm.channels", "is required")
		}
		if e := pcm.GetEncoding(); e != epdv1.PcmEncoding_PCM_ENCODING_S16LE && e != epdv1.PcmEncoding_PCM_ENCODING_F32LE {
			add(field+".pcm.encoding", "must be PCM_ENCODING_S16LE or PCM_ENCODING_F32LE")
		}
		return int64(len(pcm.GetData()))
	}
	return 0
}

func samplingViolations(s *epdv1.SamplingParams) []violation {
	var violations []violation
	add := func(field, description string) {
		violations = append(violations, violation{"sampling." + field, description})
	}
	if s.GetMaxTokens() < 1 {
		add("max_tokens", "must be at least 1")
	}
	if s != nil && s.Temperature != nil && !(*s.Temperature >= 0 && *s.Temperature <= maxTemperature) { // also refuses NaN
		add("temperature", "must be between 0 and "+pyFloat(maxTemperature))
	}
	if s != nil && s.TopP != nil && !(*s.TopP > 0 && *s.TopP <= 1) {
		add("top_p", "must be in (0, 1]")
	}
	if s != nil && s.TopK != nil && (*s.TopK == 0 || *s.TopK < -1) {
		add("top_k", "must be -1 (disabled) or >= 1")
	}
	if s.GetMinTokens() > s.GetMaxTokens() {
		add("min_tokens", "must not exceed max_tokens")
	}
	for _, stop := range s.GetStop() {
		if stop == "" {
			add("stop", "must not contain empty strings")
			break
		}
	}
	return violations
}

// checkSizes applies the checks that need no decoding: MIME types and byte sizes. Frames are
// images; raw PCM has a typed format instead of a MIME type.
func checkSizes(media []mediaItem, limits mediaLimits) *requestError {
	var violations []violation
	var total int64
	for _, m := range media {
		field, files, accepted := sourceFiles(m)
		_, isFrames := m.item.GetVideo().GetSource().(*epdv1.Video_Frames)
		for k, file := range files {
			path := field
			if isFrames {
				path = fmt.Sprintf("%s.frames[%d]", field, k)
			}
			mime := strings.ToLower(file.GetMimeType())
			if i := sort.SearchStrings(accepted, mime); i == len(accepted) || accepted[i] != mime {
				violations = append(violations, violation{path + ".mime_type", fmt.Sprintf("unsupported MIME type %s; accepted: %s", pyRepr(mime), strings.Join(accepted, ", "))})
			}
		}
		if m.nbytes > limits.maxItemBytes {
			violations = append(violations, violation{field, fmt.Sprintf("is %d bytes, over the per-item limit of %d", m.nbytes, limits.maxItemBytes)})
		}
		total += m.nbytes
	}
	if total > limits.maxRequestBytes {
		violations = append(violations, violation{"messages", fmt.Sprintf("media total %d bytes, over the per-request limit of %d", total, limits.maxRequestBytes)})
	}
	if len(violations) > 0 {
		return invalidArgument("invalid media: ", violations)
	}
	return nil
}

// sourceFiles: an item's source path (messages[m].parts[p].video.file, say), its encoded files
// and the MIME types they may have.
func sourceFiles(m mediaItem) (string, []*epdv1.Media, []string) {
	switch media := m.item.GetMedia().(type) {
	case *epdv1.MediaItem_Image:
		return m.path + ".image", []*epdv1.Media{media.Image}, supportedMimeTypes[epdv1.Modality_MODALITY_IMAGE]
	case *epdv1.MediaItem_Video:
		if frames := media.Video.GetFrames(); frames != nil {
			return m.path + ".video.frames", frames.GetFrames(), supportedMimeTypes[epdv1.Modality_MODALITY_IMAGE]
		}
		return m.path + ".video.file", []*epdv1.Media{media.Video.GetFile()}, supportedMimeTypes[epdv1.Modality_MODALITY_VIDEO]
	case *epdv1.MediaItem_Audio:
		if file := media.Audio.GetFile(); file != nil {
			return m.path + ".audio.file", []*epdv1.Media{file}, supportedMimeTypes[epdv1.Modality_MODALITY_AUDIO]
		}
		return m.path + ".audio.pcm", nil, nil
	}
	return m.path, nil, nil
}

// pyFloat writes a float as Python's str() does for the values used here (2.0, 0.01, 1000.0),
// so both gateways word a refusal alike.
func pyFloat(value float64) string {
	if value == math.Trunc(value) {
		return fmt.Sprintf("%.1f", value)
	}
	return fmt.Sprint(value)
}

// pyRepr quotes a string as Python's repr() does for plain text.
func pyRepr(text string) string {
	if strings.Contains(text, "'") && !strings.Contains(text, `"`) {
		return `"` + text + `"`
	}
	return "'" + strings.ReplaceAll(text, "'", `\'`) + "'"
}

func newRequestID() string {
	id := make([]byte, 16)
	if _, err := rand.Read(id); err != nil {
		panic(err) // the OS's randomness is gone: nothing can be served safely
	}
	return hex.EncodeToString(id)
}
